"""The recovery drill: every role a separate OS process on the real session broker, killed with SIGKILL mid-run.

- Trainer (one rank, and two ranks whose follower is the one killed): killed after a checkpoint and at least one
  more step, restarted with ``train --resume`` (``--nproc 2``: the launcher first stops the whole group and names
  the dead rank): the step
  counter continues from the checkpoint, the lost steps are trained again, no rollout id is trained twice in the
  surviving history (``trained.jsonl`` after the resume's truncation), every (prompt, epoch) ends trained (possibly
  after a stale drop and re-queue) or dead-lettered with a reason, and the run reaches its step budget.
- Scorer and producer: each is killed with SIGKILL while it holds work it has not committed, and replaced by a new
  process in the same consumer group: everything past the killed process's committed offsets is processed by its
  replacement, and the run completes with every (prompt, epoch) accounted for. The scorer is killed inside a
  batch it polled (its reward function, ``support.harness.gated_addition_reward``, stops the process while a
  gate file exists); the producer is frozen (SIGSTOP) just after a few prompts arrived (it may be generating for
  them) and before more arrive, so it certainly dies with uncommitted prompts, then killed.

Prompts are loaded in waves (``stream_rl.prompts``) so that each kill lands while work is still to come.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from support.harness import GATE_ENV, TESTS_DIR, Pipeline, demo_prompts, role_overrides, tiny_policy_dir, trained_ids

pytestmark = [pytest.mark.slow, pytest.mark.broker]

N_PROMPTS, EPOCHS, GROUP_SIZE, GROUPS_PER_STEP = 24, 2, 4, 4
STEPS = N_PROMPTS * EPOCHS // GROUPS_PER_STEP  # every (prompt, epoch) trained exactly once fills the budget
CHECKPOINT_EVERY = 3


def _config(make_config, tmp_path, **extra):
    model_dir = tiny_policy_dir(tmp_path / "policy")
    return make_config(**role_overrides(model_dir, **{
        "trainer.max_steps": STEPS, "trainer.groups_per_step": GROUPS_PER_STEP,
        "trainer.checkpoint_every": CHECKPOINT_EVERY, "trainer.max_lag": 4, **extra}))


def _status(pipe: Pipeline) -> str:
    rows = pipe.metrics()
    last = {k: rows[-1].get(k) for k in ("step", "policy_version", "batcher/ready_groups",
                                         "batcher/buffered_groups", "batcher/stale_total")} if rows else None
    return f"checkpoints {pipe.checkpoint_steps()}, last metrics {last}, accounting: {pipe.accounting().summary()}"


def _assert_complete_history(pipe: Pipeline, rows: list[dict], lines: list[dict]) -> None:
    """Steps 1..STEPS once each, no rollout id trained twice, every (prompt, epoch) accounted for."""
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), [r["step"] for r in rows]
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1)), [line["step"] for line in lines]
    twice = sorted(rid for rid, n in Counter(trained_ids(lines)).items() if n > 1)
    assert not twice, f"rollout ids trained twice in the surviving history: {twice[:10]}"
    accounting = pipe.accounting()
    assert not accounting.missing, accounting.summary()
    loaded = {(p.prompt_id, p.epoch) for p in pipe.loaded}
    assert len(loaded) == N_PROMPTS * EPOCHS
    assert accounting.trained | set(accounting.dead_lettered) == loaded, accounting.summary()
    print(accounting.summary())


def _past_a_checkpoint(pipe: Pipeline) -> bool:
    """A complete checkpoint exists and the trainer logged a later step that is not itself a checkpoint step."""
    checkpoints, steps = pipe.checkpoint_steps(), [r["step"] for r in pipe.metrics()]
    return bool(checkpoints and steps) and max(steps) > max(checkpoints) and max(steps) % CHECKPOINT_EVERY != 0


def _rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The PID of trainer rank ``rank`` among the launcher's child processes (its ``RANK`` variable)."""
    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            if f"RANK={rank}".encode() in env:
                return int(pid)
    return None


def _kill_trainer(pipe: Pipeline, trainer, ranks: int) -> None:
    """One rank: kill -9 the trainer. Two ranks: kill -9 rank 1 (a follower); the launcher must stop rank 0 too
    and exit non-zero with a line naming rank 1, within a bounded time."""
    if ranks == 1:
        assert pipe.kill9(trainer) == -9
        return
    pid = _rank_pid(trainer.proc.pid, 1)
    assert pid is not None, "rank 1 of the trainer not found among the launcher's children"
    os.kill(pid, signal.SIGKILL)
    code = trainer.proc.wait(timeout=60)  # the launcher notices, stops rank 0 and exits
    pipe.running.remove(trainer)
    assert code == 1, code
    log = trainer.log.read_text()
    assert "trainer rank 1 failed (killed by SIGKILL); every rank was stopped" in log, log[-2000:]
    assert "stream-rl train --resume --nproc 2" in log


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ranks", [1, 2])
def test_trainer_killed_mid_run_resumes_from_its_checkpoint(make_config, tmp_path, ranks):
    cfg = _config(make_config, tmp_path)
    prompts = demo_prompts(tmp_path, N_PROMPTS, EPOCHS, GROUP_SIZE)
    first_wave = 7 * GROUPS_PER_STEP  # 7 steps: not a checkpoint step, so the kill condition is always reached
    nproc = ("--nproc", str(ranks)) if ranks > 1 else ()
    with Pipeline(cfg) as pipe:
        pipe.load(prompts[:first_wave])
        trainer = pipe.start("train", 0, *nproc)
        pipe.start("score", 0)
        pipe.start("produce", 0)
        pipe.wait_until(lambda: _past_a_checkpoint(pipe), "a checkpoint and a step after it", 300,
                        diagnose=lambda: _status(pipe))
        _kill_trainer(pipe, trainer, ranks)
        killed_at = time.time()
        checkpoint = max(pipe.checkpoint_steps())
        before_rows, before_lines = pipe.metrics(), pipe.trained()
        lost = max(r["step"] for r in before_rows)
        assert lost > checkpoint, f"the drill needs steps after the checkpoint: last step {lost}, ckpt {checkpoint}"

        pipe.load(prompts[first_wave:])
        resumed = pipe.start("train", 0, "--resume", *nproc)
        pipe.wait_until(lambda: pipe.finished(resumed), f"the resumed trainer to reach step {STEPS}", 300,
                        may_exit=[resumed], diagnose=lambda: _status(pipe))
        rows, lines = pipe.metrics(), pipe.trained()
        _assert_complete_history(pipe, rows, lines)
        manifests = [m for _, _, m in pipe.read("weights", "weights_manifest")]

    # the step counter continues from the checkpoint: steps after it were all logged by the resumed process
    after = [r for r in rows if r["time"] > killed_at]
    assert after and after[0]["step"] == checkpoint + 1, (checkpoint, [r["step"] for r in after])
    assert [r["step"] for r in rows if r["time"] <= killed_at] == list(range(1, checkpoint + 1))
    # the surviving history is exactly what the checkpoint covers; the lost steps' rollouts were trained again
    kept = [ln for ln in before_lines if ln["step"] <= checkpoint]
    assert [ln for ln in lines if ln["step"] <= checkpoint] == kept
    lost_ids = set(trained_ids(ln for ln in before_lines if ln["step"] > checkpoint))
    assert lost_ids and lost_ids <= set(trained_ids(ln for ln in lines if ln["step"] > checkpoint))
    # versions never repeat or go backwards, across the crash too
    versions = [m.version for m in manifests]
    assert versions == sorted(set(versions)), versions
    assert after[0]["policy_version"] > max(r["policy_version"] for r in before_rows)


def _orphaned(pipe: Pipeline, role_group: str, logical: str, kind: str) -> tuple[list, dict[int, int]]:
    """After a kill: the messages between the group's committed offsets and the high-water marks (the work the
    dead process left), and those high-water marks."""
    marks, committed = pipe.highwaters(logical), pipe.committed(role_group, logical)
    return [m for part, off, m in pipe.read(logical, kind) if committed[part] <= off < marks[part]], marks


def _committed_past(pipe: Pipeline, role_group: str, logical: str, marks: dict[int, int]) -> bool:
    committed = pipe.committed(role_group, logical)
    return all(committed[p] >= mark for p, mark in marks.items())


@pytest.mark.timeout(600)
def test_scorer_and_producer_killed_mid_run_are_replaced_and_the_run_completes(make_config, tmp_path, monkeypatch):
    gate, held = tmp_path / "gate", tmp_path / "gate.held"
    monkeypatch.setenv(GATE_ENV, str(gate))  # the role processes inherit the environment
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")])))
    cfg = _config(make_config, tmp_path, **{"scorer.reward_fn": "support.harness:gated_addition_reward"})
    prompts = demo_prompts(tmp_path, N_PROMPTS, EPOCHS, GROUP_SIZE)
    third = len(prompts) // 3
    with Pipeline(cfg) as pipe:
        pipe.load(prompts[:third])
        trainer = pipe.start("train", 0)
        scorer = pipe.start("score", 0)
        producer = pipe.start("produce", 0)
        pipe.wait_until(lambda: len(pipe.metrics()) >= 1, "the first trainer step", 300,
                        diagnose=lambda: _status(pipe))

        # scorer: stops itself inside a batch it polled (gate), is killed there, then replaced
        gate.touch()
        pipe.load(prompts[third:2 * third])
        pipe.wait_until(held.exists, "the scorer to stop inside a batch", 120, diagnose=lambda: _status(pipe))
        pipe.freeze(scorer, signal_it=False)
        assert pipe.kill9(scorer) == -9
        gate.unlink()
        orphaned_rollouts, rollout_marks = _orphaned(pipe, "scorers", "rollouts", "rollout")
        held_prompt = held.read_text()
        scorer_killed_at = time.time()
        pipe.start("score", 1)
        pipe.wait_until(lambda: any(r["time"] > scorer_killed_at for r in pipe.metrics()),
                        "a trainer step after the scorer was replaced", 180, diagnose=lambda: _status(pipe))

        # producer: frozen just after prompts arrive (maybe mid-batch), more prompts loaded, killed, replaced
        pipe.load(prompts[2 * third:2 * third + 8])
        pipe.freeze(producer)
        pipe.load(prompts[2 * third + 8:])
        assert pipe.kill9(producer) == -9
        orphaned_prompts, prompt_marks = _orphaned(pipe, "producers", "prompts", "prompt")
        pipe.start("produce", 1)
        pipe.wait_until(lambda: pipe.finished(trainer), f"the trainer to reach step {STEPS}", 300,
                        may_exit=[trainer], diagnose=lambda: _status(pipe))
        _assert_complete_history(pipe, pipe.metrics(), pipe.trained())
        pipe.wait_until(lambda: _committed_past(pipe, "scorers", "rollouts", rollout_marks),
                        "the new scorer to commit past the dead scorer's rollouts", 60, may_exit=[trainer])
        pipe.wait_until(lambda: _committed_past(pipe, "producers", "prompts", prompt_marks),
                        "the new producer to commit past the dead producer's prompts", 60, may_exit=[trainer])
        scored = [m for _, _, m in pipe.read("scored", "scored_rollout")]
        rollouts = [m for _, _, m in pipe.read("rollouts", "rollout")]

    scorers_of = _assert_taken_over(scored, orphaned_rollouts, "scorer", lambda r: r.rollout_id)
    assert held_prompt in {r.prompt_text for r in orphaned_rollouts}, \
        f"the rollout the scorer was killed on ({held_prompt!r}) is not past its committed offsets"
    producers_of = _assert_taken_over(rollouts, orphaned_prompts, "producer",
                                      lambda r: (r.prompt_id, r.epoch, r.attempt))
    twice = sum(len(ids) > 1 for ids in scorers_of.values())
    regenerated = sum(len(ids) > 1 for ids in producers_of.values())
    print(f"{len(orphaned_rollouts)} rollouts and {len(orphaned_prompts)} prompts redelivered; {twice} rollouts "
          f"scored by both scorers, {regenerated} prompts generated by both producers (duplicates by rollout id)")


def _assert_taken_over(outputs: list, orphaned: list, role: str, key) -> dict:
    """Role instance 0 produced outputs, instance 0 died holding ``orphaned`` inputs, and instance 1 produced an
    output for every one of them. Returns {input key: ids of the instances that produced an output for it}."""
    made_by = defaultdict(set)
    for out in outputs:
        made_by[key(out)].add(getattr(out, f"{role}_id"))
    assert any(f"{role}-0" in ids for ids in made_by.values()), f"the first {role} never produced anything"
    assert orphaned, f"the killed {role} held no uncommitted input: the drill proved nothing"
    missed = [key(m) for m in orphaned if f"{role}-1" not in made_by[key(m)]]
    assert not missed, f"inputs past the dead {role}'s commit not processed by its successor: {missed[:10]}"
    return made_by
