"""Issue 45.2: kills at exact points of the send -> commit path (``stream_rl.runtime.failpoints``), one test per
point, each on the real broker with every role a separate process, and backpressure on (a restarted producer
inherits its predecessor's groups in flight, ``producers.stale_feed.groups_in_flight``):

- ``producer.after_send``: the producer dies after its first batch's rollouts were acknowledged and before its
  prompts were committed. Its successor (same producer id) generates the same prompts again under the same
  rollout ids, the scorers score both copies, and the trainer drops the second as a duplicate: the
  de-duplication path the storm's random kills never reached.
- ``trainer.after_checkpoint``: the trainer dies after writing a checkpoint and before committing its offsets;
  ``train --resume`` reads from the checkpoint's offsets, not the group's.

After each, once the trainer reaches its step budget and exits: ``trained.jsonl`` holds steps 1..N once each and
no rollout id twice; the final checkpoint's ledger is exactly the (prompt, epoch) groups of ``trained.jsonl``; the
trainer group's committed offsets are the final checkpoint's; every scored record below them is trained, stale
or dead-lettered. Counted in steps and records: no timing decides the outcome.
"""

from __future__ import annotations

import signal
from collections import Counter

import pytest
from support.harness import Pipeline, demo_prompts, role_overrides, tiny_policy_dir, trained_ids

from consumers.trainer.ledger import Ledger, split_rollout_id
from stream_rl.runtime import failpoints

pytestmark = [pytest.mark.slow, pytest.mark.broker]

N_PROMPTS, GROUP_SIZE, GROUPS_PER_STEP = 16, 2, 2
STEPS = N_PROMPTS // GROUPS_PER_STEP
ROLE_OF = {"producer.after_send": "produce", "trainer.after_checkpoint": "train"}


def _final_checkpoint(pipe: Pipeline):
    from stream_rl.storage.checkpoint import complete_checkpoints, load_checkpoint

    return load_checkpoint(complete_checkpoints(pipe.run_dir / "checkpoints")[-1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("point", sorted(ROLE_OF))
def test_a_kill_at_a_failpoint_leaves_ledger_history_and_offsets_in_agreement(make_config, tmp_path, monkeypatch,
                                                                              point):
    root = tmp_path / "failpoints"
    monkeypatch.setenv(failpoints.ENV, str(root))  # the role processes inherit it
    failpoints.arm(root, point)  # one-shot: the first pass through the point kills its process
    model_dir = tiny_policy_dir(tmp_path / "policy")
    cfg = make_config(**role_overrides(model_dir, **{
        "trainer.groups_per_step": GROUPS_PER_STEP, "trainer.max_steps": STEPS, "trainer.checkpoint_every": 2,
        "trainer.max_lag": 8, "trainer.max_requeues": 100, "producer.prompts_per_batch": 4,
        "producer.versions_ahead": 1, "producer.max_groups_per_version": GROUPS_PER_STEP}))
    with Pipeline(cfg) as pipe:
        pipe.load(demo_prompts(tmp_path, N_PROMPTS, 1, GROUP_SIZE))
        kids = {role: pipe.start(role, 0) for role in ("train", "score", "produce")}
        victim = kids[ROLE_OF[point]]
        pipe.wait_until(lambda: victim.proc.poll() is not None, f"the {victim.role} to die at {point}", 180,
                        may_exit=[victim])
        assert victim.proc.returncode == -signal.SIGKILL, (point, victim.proc.returncode)
        pipe.running.remove(victim)
        role = ROLE_OF[point]
        kids[role] = pipe.start(role, 0, *(("--resume",) if role == "train" else ()))  # same id: producer-0
        pipe.wait_until(lambda: pipe.finished(kids["train"]), f"the trainer to reach step {STEPS}", 240,
                        may_exit=[kids["train"]])
        lines, rows, ckpt = pipe.trained(), pipe.metrics(), _final_checkpoint(pipe)
        committed = {(pipe.names.scored, p): off for p, off in pipe.committed("trainer", "scored").items()}
        scored = pipe.read("scored", "scored_rollout")
        rollouts = [m.rollout_id for _, _, m in pipe.read("rollouts", "rollout")]
        stale = {m.rollout_id for _, _, m in pipe.read("stale", "stale_rollout")}
        accounting = pipe.accounting()

    assert [ln["step"] for ln in lines] == list(range(1, STEPS + 1)), [ln["step"] for ln in lines]
    ids = trained_ids(lines)
    assert len(ids) == len(set(ids)) == N_PROMPTS * GROUP_SIZE, Counter(ids).most_common(3)
    assert ckpt.step == STEPS
    assert Ledger.from_json(ckpt.ledger["groups"]).groups() == {split_rollout_id(rid) for rid in ids}
    assert committed == {k: v for k, v in ckpt.offsets.items() if k[0] == pipe.names.scored}
    below = [m.rollout_id for p, o, m in scored if o < committed[(pipe.names.scored, p)]]
    assert len(below) == len(scored) and set(below) <= set(ids) | stale
    assert not accounting.missing, accounting.summary()
    copies = Counter(rollouts)
    if point == "producer.after_send":  # the first batch went out twice; the trainer kept one copy of each
        assert max(copies.values()) == 2, "the producer died before sending anything: the drill proved nothing"
        assert rows[-1]["batcher/duplicates_total"] >= sum(n - 1 for n in copies.values())
    print(f"{point}: {sum(n - 1 for n in copies.values())} rollouts generated twice, "
          f"duplicates dropped {rows[-1]['batcher/duplicates_total']:.0f}, stale {len(stale)}")
