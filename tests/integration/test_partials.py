"""Durable partial rollouts (issue 41.2) on the tiny real Llama, float32:

- the hf engine hands each cut group's prefixes to ``on_cut``: the tokens, logprobs and versions of the same RNG
  stream as an uncut call, cut at the step the loop stopped (ended rows whole);
- a cut group resumed on newer weights is one rollout per sample whose tokens carry the versions that produced
  them (prefix v0, continuation v1) and whose continuation logprobs are those of the new weights given prompt +
  prefix;
- the kill drill on the real broker, every role a process: a producer dies (failpoint
  ``producer.after_partials``) with the prefixes of its cut groups on the partials topic and their prompts
  committed; another producer, started once the trainer has published v1, adopts them through the group's
  rebalance (the producers' group reads the partials topic with the prompts) and resumes them; the trainer trains
  every group exactly once, each resumed rollout carrying its prefix (v0) and its continuation (v1 or newer),
  and no group is regenerated from scratch. The drill runs twice: on the hf engine, and on a real ``vllm serve``
  (the server engine aborts the tail's requests on the server and resumes the prefixes there).
"""

from __future__ import annotations

import signal
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import pytest
from support.producers import PROMPTS, build_tiny_model_dir, perturbed_state_dict, prompt_record

from producers.engines.base import Sample, Sampling
from producers.engines.hf import HFEngine, score_tokens
from producers.step import EarlyStop, produce_rollouts
from producers.partials import prefixes, resume_partials

SAMPLING = Sampling(temperature=1.0, stop_token_ids=tuple(range(3, 8)))  # rows end at very different steps
BUDGET = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("partials") / "policy")


def test_the_engine_hands_over_each_cut_groups_prefixes_from_the_same_stream(model_dir):
    engine = HFEngine.from_dir(model_dir)
    prompts = PROMPTS * 2  # 6 groups
    full = engine.generate(prompts, 3, SAMPLING, BUDGET, seed=4)
    calls: list[list[bool]] = []
    cut: dict[int, tuple] = {}

    def stop_when(ended: list[bool]) -> bool:
        calls.append(list(ended))
        return sum(ended) >= 2

    out = engine.generate(prompts, 3, SAMPLING, BUDGET, seed=4, stop_when=stop_when,
                          on_cut=lambda b, samples, running: cut.__setitem__(b, (samples, running)))
    steps = len(calls)  # the loop stopped after drawing token `steps - 1`
    assert sorted(cut) == [b for b, ended in enumerate(calls[-1]) if not ended] and cut
    assert all(out[b] == [] for b in cut)
    for b, (samples, running) in cut.items():
        assert any(running)
        for sample, run, whole in zip(samples, running, full[b], strict=True):
            if run:  # still running at the cut: the first `steps` tokens of the uncut sample
                assert sample.token_ids == whole.token_ids[:steps] and len(sample.token_ids) == steps
                assert sample.logprobs == whole.logprobs[:steps]
            else:
                assert sample == whole


def test_a_cut_group_resumed_on_newer_weights_carries_the_versions_that_produced_its_tokens(model_dir):
    engine = HFEngine.from_dir(model_dir)
    prompts = [prompt_record(i, group_size=3) for i in range(6)]
    kw = {"producer_id": "p0", "sampling": SAMPLING, "max_new_tokens": BUDGET, "seed": 3}
    result = produce_rollouts(prompts, engine, early_stop=EarlyStop(oversample=1.0, keep_partials=True), **kw)
    assert result.partials and [p.prompt.prompt_id for p in result.partials] == [f"p{i}" for i in result.aborted]
    assert {r.group_id for r in result.rollouts}.isdisjoint(p.group_id for p in result.partials)
    engine.load_weights(perturbed_state_dict(model_dir), version=1)
    resumed = resume_partials(result.partials, engine, max_lag=1, **kw)
    assert resumed.metrics["producer/partials_resumed"] == len(result.partials)
    by_id = {r.rollout_id: r for r in resumed.rollouts}
    mixed = 0
    for partial in result.partials:
        for i, (prefix, was_cut) in enumerate(prefixes(partial)):
            rollout = by_id[f"{partial.group_id}:{i}"]
            length = len(prefix.token_ids)
            tokens, versions = rollout.response_token_ids.tolist(), rollout.token_policy_versions.tolist()
            assert tokens[:length] == prefix.token_ids and versions[:length] == [0] * length
            assert rollout.behavior_logprobs[:length].tolist() == pytest.approx(prefix.logprobs)
            assert len(tokens) <= BUDGET
            if not was_cut:
                assert tokens == prefix.token_ids and rollout.finish_reason == prefix.finish_reason
                continue
            assert versions[length:] == [1] * (len(tokens) - length) and len(tokens) > length
            mixed += 1
            context = partial.prompt_token_ids.tolist() + prefix.token_ids  # the new weights' own logprobs
            want = score_tokens(engine.model, context, tokens[length:], SAMPLING)
            assert rollout.behavior_logprobs[length:].tolist() == pytest.approx(want, abs=1e-4)
    assert mixed >= 1


class _Crash(BaseException):
    """Stands in for the SIGKILL of a failpoint inside a producer thread (nothing after it runs, nothing commits)."""


def test_a_crash_between_the_partials_flush_and_the_prompts_commit_loses_nothing(model_dir, tmp_path, run_name,
                                                                                monkeypatch):
    """The in-process bus: the producer dies where ``producer.after_send`` kills it (its rollouts and its cut
    groups' prefixes acknowledged, its prompts not committed); its successor in the group regenerates the batch
    and resumes the prefixes: every rollout id is there, at least twice (duplicates by id, which the trainer
    drops), the dead producer's prefixes resumed, and both topics end committed."""
    from collections import Counter

    from producers import role as producer_role
    from producers.config import ProducerConfig
    from support.memory_bus import memory_config
    from stream_rl.transport.client import Transport
    from support.producers import send_prompts, start_producer
    from support.topics import caught_up, read_records
    from support.waiting import wait_for

    real_hit = producer_role.failpoints.hit

    def hit(name: str) -> None:
        if name == "producer.after_send" and not crashed:
            crashed.append(name)
            raise _Crash(name)
        real_hit(name)

    crashed: list[str] = []
    monkeypatch.setattr(producer_role.failpoints, "hit", hit)
    engine = HFEngine.from_dir(model_dir)
    cfg = memory_config(run_name, tmp_path / "run")
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    send_prompts(transport, [prompt_record(i, group_size=3) for i in range(6)])
    pcfg = ProducerConfig(follow_weights=False, prompts_per_batch=6, max_new_tokens=BUDGET, poll_timeout_s=0.2,
                          stop_token_ids=list(SAMPLING.stop_token_ids), seed=3, oversample=1.0, partial_max_lag=0)
    thread, _, _, out = start_producer(cfg, pcfg, engine)
    thread.join(60)
    assert isinstance(out.get("error"), _Crash)  # died after the flush, before the commit
    dead = read_records(transport, transport.names.partials, "partial_group")
    assert dead and not caught_up(transport, transport.names.group("producers"), transport.names.prompts)
    thread, stop, stats, out = start_producer(cfg, pcfg, engine)
    group = transport.names.group("producers")
    wait_for(lambda: caught_up(transport, group, transport.names.prompts)
             and caught_up(transport, group, transport.names.partials) and stats.partials_resumed >= len(dead),
             "the successor to commit the prompts and every partial group", 60.0, watch=[out])
    stop.set()
    thread.join(60)
    rollouts = [r.value for r in read_records(transport, transport.names.rollouts, "rollout")]
    copies = Counter(r.rollout_id for r in rollouts)
    assert set(copies) == {f"p{i}:0:{k}" for i in range(6) for k in range(3)}  # nothing lost
    assert min(copies.values()) >= 2  # the batch went out again (regenerated, the cut groups resumed): duplicates
    for partial in dead:  # the dead producer's prefixes were resumed too
        for k, (prefix, _) in enumerate(prefixes(partial.value)):
            assert any(r.response_token_ids[:len(prefix.token_ids)].tolist() == prefix.token_ids
                       and r.response_length >= len(prefix.token_ids)
                       for r in rollouts if r.rollout_id == f"{partial.value.group_id}:{k}")


def test_a_producer_without_partial_max_lag_refuses_to_start_while_partial_groups_wait(model_dir, tmp_path,
                                                                                      run_name):
    """Partial groups on the topic (the run had ``producer.partial_max_lag`` set) and a producer started without it:
    it would never read them, and their prompts are committed, so it refuses at start naming the setting; with the
    setting it starts and resumes them; once they are resumed, a producer without it starts."""
    from producers.config import ProducerConfig
    from producers.partials import partial_group
    from stream_rl.config.base import ConfigError
    from stream_rl.transport.client import Transport
    from support.memory_bus import memory_config
    from support.producers import start_producer
    from support.topics import caught_up
    from support.waiting import wait_for

    cfg = memory_config(run_name, tmp_path / "run")
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    cut = partial_group(prompt_record(0, group_size=1), [1, 4, 13, 5, 14], [Sample([9, 9], [-0.5, -0.5], "length",
                                                                                  [0, 0])],
                        [True], version=0, producer_id="gone")
    sink = transport.sink()
    sink.send(transport.names.partials, cut, key=cut.group_id)
    sink.flush()
    sink.close()
    engine = HFEngine.from_dir(model_dir)
    plain = ProducerConfig(follow_weights=False, max_new_tokens=BUDGET, poll_timeout_s=0.2)
    thread, _, _, out = start_producer(cfg, plain, engine)
    thread.join(30)
    assert isinstance(out.get("error"), ConfigError)
    assert str(out["error"]).startswith("producer.partial_max_lag is unset, but ") and "1 partial group(s)" in str(
        out["error"])
    durable = plain.model_copy(update={"oversample": 1.0, "partial_max_lag": 0})
    thread, stop, stats, out = start_producer(cfg, durable, engine)
    group = transport.names.group("producers")
    wait_for(lambda: stats.partials_resumed == 1 and caught_up(transport, group, transport.names.partials),
             "the partial group resumed and committed", 60.0, watch=[out])
    stop.set()
    thread.join(60)
    thread, stop, _, out = start_producer(cfg, plain, engine)  # drained: the setting may go
    thread.join(2)
    assert thread.is_alive() and "error" not in out
    stop.set()
    thread.join(60)


# ------------------------------------------------------------------------------------------------ the kill drill
N_PROMPTS, GROUP_SIZE, GROUPS_PER_STEP = 8, 2, 2
STEPS = N_PROMPTS // GROUPS_PER_STEP


def _engine_settings(engine: str, model_dir: Path, stack: ExitStack, logs: Path) -> dict:
    """The drill's producer settings for ``engine``: hf cuts a batch once half its groups ended (stop ids 3-7: rows
    end at very different steps); a ``vllm serve`` of the policy, started here, aborts the requests still running
    once one group ended (eos only, 40 tokens: its groups end far apart, so the abort finds samples mid-way), and
    its trainer steps on one group (a batch may leave only one complete)."""
    if engine == "hf":
        return {"producer.max_new_tokens": BUDGET, "producer.stop_token_ids": "[3, 4, 5, 6, 7]",
                "producer.oversample": "1.0"}
    from support.vllm_servers import started_servers, vllm_problem

    if vllm_problem() is not None:
        pytest.skip(str(vllm_problem()))
    (server,) = stack.enter_context(started_servers(model_dir, 1, logs))
    return {"producer.engine": "server", "producer.server.urls": f'["{server.url}"]', "producer.max_new_tokens": 40,
            "producer.abort_after_s": "0.001", "trainer.groups_per_step": 1, "trainer.max_steps": N_PROMPTS}


@pytest.mark.slow
@pytest.mark.broker
@pytest.mark.timeout(420)
@pytest.mark.parametrize("engine", ["hf", "server"])
def test_a_producer_killed_with_partial_rollouts_outstanding_leaves_them_to_another(engine, make_config, tmp_path,
                                                                                    monkeypatch):
    """The kill drill on the hf engine, and on a real ``vllm serve`` (issue 41: "a producer killed with partial
    rollouts outstanding resumes them", on servers)."""
    from support.harness import role_overrides, tiny_policy_dir

    from stream_rl.runtime import failpoints

    root = tmp_path / "failpoints"
    monkeypatch.setenv(failpoints.ENV, str(root))  # the role processes inherit it
    failpoints.arm(root, "producer.after_partials")
    model_dir = tiny_policy_dir(tmp_path / "policy")
    with ExitStack() as stack:
        settings = _engine_settings(engine, model_dir, stack, tmp_path / "server-logs")
        cfg = make_config(**role_overrides(model_dir, **{
            "trainer.groups_per_step": GROUPS_PER_STEP, "trainer.max_steps": STEPS, "trainer.checkpoint_every": 2,
            "trainer.max_lag": 8, "producer.prompts_per_batch": 4, "producer.partial_max_lag": 8, **settings}))
        _drill(cfg, tmp_path)


def _drill(cfg, tmp_path: Path) -> None:
    """Kill the producer once it has partial groups outstanding, start another, check every group trains once."""
    from support.harness import Pipeline, demo_prompts, trained_ids

    with Pipeline(cfg) as pipe:
        pipe.load(demo_prompts(tmp_path, N_PROMPTS, 1, GROUP_SIZE))
        kids = {role: pipe.start(role, 0) for role in ("train", "score", "produce")}
        victim = kids["produce"]
        pipe.wait_until(lambda: victim.proc.poll() is not None, "the producer to die with partials outstanding",
                        120, may_exit=[victim])
        assert victim.proc.returncode == -signal.SIGKILL, victim.proc.returncode
        pipe.running.remove(victim)
        partials = [m for _, _, m in pipe.read("partials", "partial_group")]
        assert partials, "the producer died without a partial group: the drill proved nothing"
        assert sum(pipe.committed("producers", "partials").values()) == 0  # none resumed yet
        pipe.wait_until(lambda: len(pipe.metrics()) >= 1, "the trainer's first step (weights v1)", 120,
                        may_exit=[kids["train"]])  # the dead producer's complete groups fill it
        pipe.start("produce", 1)  # another producer of the group: it adopts the prompts and the partials
        pipe.wait_until(lambda: pipe.finished(kids["train"]), "the trainer's last step", 240,
                        may_exit=[kids["train"]])
        lines = pipe.trained()
        rollouts = [m for _, _, m in pipe.read("rollouts", "rollout")]
        accounting = pipe.accounting()
        every = [m for _, _, m in pipe.read("partials", "partial_group")]  # the survivor's own cuts too
        resumed_commits = sum(pipe.committed("producers", "partials").values())

    ids = trained_ids(lines)
    assert len(ids) == len(set(ids)) == N_PROMPTS * GROUP_SIZE, Counter(ids).most_common(3)  # each group once
    assert not accounting.missing, accounting.summary()
    copies = Counter(r.rollout_id for r in rollouts)
    assert max(copies.values()) == 1  # nothing regenerated from scratch: the cut groups were resumed
    assert resumed_commits == len(every) and {p.group_id for p in partials} <= {p.group_id for p in every}
    by_id = {r.rollout_id: r for r in rollouts}
    for partial in every:
        for i, (prefix, was_cut) in enumerate(prefixes(partial)):
            rollout = by_id[f"{partial.group_id}:{i}"]
            length = len(prefix.token_ids)
            assert rollout.rollout_id in set(ids)
            assert rollout.response_token_ids[:length].tolist() == prefix.token_ids
            assert rollout.token_policy_versions[:length].tolist() == prefix.token_versions
            assert partial not in partials or rollout.producer_id != partial.producer_id  # the dead one's: adopted
            assert not was_cut or rollout.response_length > length
            if was_cut and partial in partials:  # prefix v0 by the dead producer, continued on v1 or newer, trained
                assert set(prefix.token_versions) == {0} and min(rollout.token_policy_versions[length:]) >= 1
    kept = sum(int(p.sample_lengths.sum()) for p in every)
    versions = sorted({tuple(sorted(set(by_id[f"{p.group_id}:{i}"].token_policy_versions.tolist())))
                       for p in every for i in range(GROUP_SIZE)})
    print(f"{len(partials)} partial group(s) left by the killed producer, {len(every)} in all, {kept} prefix tokens "
          f"kept; versions in the resumed rollouts: {versions}")
