"""The scorer: reward references, reference log-probs, reward model, the pure step, and the loop on the real broker."""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections import Counter

import numpy as np
import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import ValidationError
from support.scorer import VOCAB, ScorerThread, group_rollouts, llama_config, make_rollout, send_rollouts, trace_id  # noqa: F401
from support.topics import check_role_telemetry, heartbeats, only_export, read_records
from support.waiting import wait_for
from transformers import LlamaForCausalLM, LlamaForSequenceClassification

from consumers.scorer.builtin_rewards import contains_answer, exact_match, last_number_match
from consumers.scorer.config import ScorerConfig
from consumers.scorer.reference import ReferenceLogprobs
from consumers.scorer.reward_model import RewardModelScorer
from consumers.scorer.rewards import RewardFnError, RewardValueError, check_reward_value, load_reward_fn
from consumers.scorer.scoring import Rejected, Scoring, load_scoring, score_rollouts
from schemas import DeadLetter, Rollout, ScoredRollout, decode, validate
from stream_rl.transport.client import Transport
from stream_rl.transport.tracing import Tracing

torch.set_num_threads(1)
THIS = __name__  # importable as a module by the reward loader (pytest puts tests/ on sys.path)


# ---------------------------------------------------------------- helpers


def poisonable_reward(prompt, response, answer, metadata):
    """Test reward: NaN or an exception when the metadata asks for it, else exact match."""
    if metadata.get("poison") == "nan":
        return float("nan")
    if metadata.get("poison") == "raise":
        raise ZeroDivisionError("poisoned")
    if metadata.get("poison") == "dense":
        return {"reward": 1.0, "token_rewards": [0.25] * int(metadata["length"])}
    return exact_match(prompt, response, answer, metadata)






@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config()).eval()


@pytest.fixture(scope="module")
def classifier():
    torch.manual_seed(1)
    return LlamaForSequenceClassification(llama_config(num_labels=1)).eval()


def manual_ref_logprobs(model, rollout: Rollout) -> np.ndarray:
    """Full forward of one unpadded sequence, log_softmax(logits / T), gather the response tokens."""
    ids = torch.tensor(np.concatenate([rollout.prompt_token_ids, rollout.response_token_ids]), dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].float()  # [L, V]
    logp = torch.log_softmax(logits[:-1] / rollout.temperature, dim=-1)  # [L-1, V]
    picked = logp.gather(-1, ids[1:, None])[:, 0]  # [L-1]
    return picked[-rollout.response_length:].numpy()


# ---------------------------------------------------------------- reward references and values


@pytest.mark.parametrize("reference, message", [
    ("no_colon", "exactly one ':'"),
    ("a:b:c", "exactly one ':'"),
    ("consumers.scorer:", "function part ''"),
    (":exact_match", "module part ''"),
    ("1mod:fn", "module part '1mod'"),
    ("consumers.scorer.builtin_rewards:exact-match", "function part 'exact-match'"),
    ("consumers.scorer.no_such_module:fn", "module 'consumers.scorer.no_such_module' not found"),
    ("consumers.scorer.builtin_rewards:nope", "has no attribute 'nope'"),
    ("consumers.scorer.config:DEFAULT_REWARD_FN", "is a str, not callable"),
    ("math:sqrt", "cannot be called as fn(prompt, response, answer, metadata)"),
])
def test_bad_reward_references_name_the_problem(reference, message):
    with pytest.raises(RewardFnError) as err:
        load_reward_fn(reference)
    assert message in str(err.value) and repr(reference) in str(err.value)


def test_module_that_fails_to_import_is_reported_as_such(tmp_path, monkeypatch):
    (tmp_path / "scorer_broken_dep.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "scorer_broken_code.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardFnError, match="importing module 'scorer_broken_dep' failed.*no_such_dependency_xyz"):
        load_reward_fn("scorer_broken_dep:f")
    with pytest.raises(RewardFnError, match="importing module 'scorer_broken_code' failed.*boom at import"):
        load_reward_fn("scorer_broken_code:f")
    for name in ("scorer_broken_dep", "scorer_broken_code"):
        sys.modules.pop(name, None)


def test_good_references_load_and_config_checks_reward_sources():
    assert load_reward_fn("consumers.scorer.builtin_rewards:exact_match") is exact_match
    assert load_reward_fn(f"{THIS}:poisonable_reward") is poisonable_reward
    with pytest.raises(ValidationError, match="exactly one ':'"):
        ScorerConfig(reward_fn="not-a-reference")
    with pytest.raises(ValidationError, match="needs a reward source"):
        ScorerConfig(reward_fn=None)
    with pytest.raises(ValidationError):
        ScorerConfig(batch_size=0)
    with pytest.raises(ValidationError):
        ScorerConfig(reward_model_weight=float("nan"))
    assert ScorerConfig(reward_fn=None, reward_model_dir="/models/rm").reward_fn is None


def test_reward_values_are_checked():
    assert check_reward_value(1, 3).reward == 1.0 and check_reward_value(1, 3).token_rewards is None
    assert check_reward_value(True, 3).reward == 1.0
    assert check_reward_value(np.float32(0.5), 3).reward == 0.5
    out = check_reward_value({"reward": 2, "token_rewards": [0, 1, 1]}, 3)
    assert out.reward == 2.0 and out.token_rewards.dtype == np.float32 and out.token_rewards.tolist() == [0, 1, 1]
    bad = [(float("nan"), "non-finite reward nan"), (float("-inf"), "non-finite reward -inf"),
           ("1.0", "returned str"), (None, "returned NoneType"), ({"rewards": 1.0}, "unknown keys ['rewards']"),
           ({"token_rewards": [0, 0, 1]}, "without 'reward'"), ({"reward": 1, "token_rewards": [1, 2]}, "[3]"),
           ({"reward": 1, "token_rewards": [0, float("nan"), 0]}, "non-finite token_rewards at positions [1]"),
           ({"reward": float("nan")}, "non-finite reward")]
    for value, message in bad:
        with pytest.raises(RewardValueError) as err:
            check_reward_value(value, 3)
        assert message in str(err.value), (value, str(err.value))


def test_builtin_rewards():
    assert exact_match("3+4=", "7<eos>", "7", {}) == 1.0
    assert exact_match("3+4=", "77", "7", {}) == 0.0
    assert exact_match("3+4=", "7<eos>8", "7", {}) == 0.0
    assert contains_answer("q", "the answer is 7.", "7", {}) == 1.0
    assert last_number_match("q", "so 3 + 4 = 7.0</s>", "7", {}) == 1.0
    assert last_number_match("q", "7 or 8", "7", {}) == 0.0
    with pytest.raises(ValueError, match="reference answer"):
        exact_match("q", "7", None, {})


# ---------------------------------------------------------------- models


def test_reference_logprobs_equal_a_manual_forward_on_right_padded_batches(policy):
    rollouts = [make_rollout(0, prompt_ids=(1, 5, 6), response_ids=(7, 8, 9, 10, 2), temperature=1.0),
                make_rollout(1, prompt_ids=(1, 3, 4, 5, 6, 7, 8), response_ids=(11, 2), temperature=0.7),
                make_rollout(2, prompt_ids=(1,), response_ids=(4, 4, 9, 12, 13, 2), temperature=1.3),
                make_rollout(3, prompt_ids=(1, 9, 9, 9, 9), response_ids=(31,), temperature=1.0)]
    expected = [manual_ref_logprobs(policy, r) for r in rollouts]
    for batch_size in (3, 16):  # 3: chunks of 3 + 1 (the lone row keeps only its last logits); 16: one batch
        got = ReferenceLogprobs(policy, batch_size=batch_size).logprobs(rollouts)
        for r, g, e in zip(rollouts, got, expected, strict=True):
            assert g.dtype == np.float32 and g.shape == (r.response_length,)
            np.testing.assert_allclose(g, e, atol=1e-5, rtol=0)
            assert (g <= 0).all()
    # the temperature matters: the same tokens at T=1 give different values
    at_one = ReferenceLogprobs(policy).logprobs([make_rollout(1, prompt_ids=(1, 3, 4, 5, 6, 7, 8),
                                                              response_ids=(11, 2))])[0]
    assert np.abs(at_one - expected[1]).max() > 1e-3


def test_reference_rejects_what_it_cannot_score(policy):
    # 16-bit reference and reward models (scorer.dtype): tests/unit/test_scorer_precision.py
    ref = ReferenceLogprobs(policy)
    with pytest.raises(ValueError, match="response token id 40 is outside the reference model's vocabulary"):
        ref.check(make_rollout(0, response_ids=(3, 40)))
    with pytest.raises(ValueError, match="max_position_embeddings 32"):
        ref.check(make_rollout(0, prompt_ids=tuple(range(1, 31)), response_ids=(3, 4, 5)))


def test_reward_model_scores_are_finite_per_sequence_and_batch_invariant(classifier):
    from stream_rl.demo.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    rollouts = []
    for i, (prompt, response) in enumerate([("12+34=", "46"), ("5+5=", "10<eos>"), ("99+1=", "100")]):
        prompt_ids = tokenizer(prompt)["input_ids"]
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
        rollouts.append(make_rollout(i, prompt_ids=prompt_ids, response_ids=response_ids, prompt_text=prompt,
                                     response_text=response))
    by_tokens = RewardModelScorer(classifier, batch_size=2)
    ids = [by_tokens.token_ids(r) for r in rollouts]
    batched = by_tokens.scores(ids)
    alone = [by_tokens.scores([seq])[0] for seq in ids]
    assert all(math.isfinite(s) for s in batched) and len(set(batched)) == 3
    np.testing.assert_allclose(batched, alone, atol=1e-5)
    by_text = RewardModelScorer(classifier, tokenizer, input_mode="text", batch_size=8)
    np.testing.assert_allclose(by_text.scores([by_text.token_ids(r) for r in rollouts]), batched, atol=1e-5)
    with pytest.raises(ValueError, match="outside the reward model's vocabulary"):
        by_tokens.token_ids(make_rollout(0, response_ids=(50,)))
    no_pad = LlamaForSequenceClassification(llama_config(num_labels=1))
    no_pad.config.pad_token_id = None
    with pytest.raises(ValueError, match="no pad_token_id"):
        RewardModelScorer(no_pad)


# ---------------------------------------------------------------- the pure step


def test_step_combines_rewards_attaches_ref_logprobs_and_rejects_bad_records(policy, classifier):
    reference, reward_model = ReferenceLogprobs(policy), RewardModelScorer(classifier)
    scoring = Scoring(scorer_id="scorer-t", reward_fn=poisonable_reward, reward_fn_weight=0.5,
                      reward_model=reward_model, reward_model_weight=2.0, reference=reference,
                      token_level_rewards=True)
    rollouts = [make_rollout(0, response_text="7", answer="7"),                        # correct
                make_rollout(1, response_text="8", answer="7"),                        # wrong
                make_rollout(2, metadata={"poison": "nan"}),                            # NaN reward
                make_rollout(3, metadata={"poison": "raise"}),                          # reward fn raises
                make_rollout(4, metadata={"poison": "dense", "length": "3"}),           # token rewards
                make_rollout(5, response_ids=(3, 40))]                                 # not in the vocabulary
    out = score_rollouts(rollouts, scoring)
    assert [type(o) for o in out] == [ScoredRollout, ScoredRollout, Rejected, Rejected, ScoredRollout, Rejected]
    assert [o.rollout.rollout_id for o in out] == [r.rollout_id for r in rollouts]
    assert "non-finite reward nan" in out[2].reason and out[2].error_type == "RewardValueError"
    assert "raised ZeroDivisionError: poisoned" in out[3].reason and out[3].error_type == "ZeroDivisionError"
    assert "reward model cannot score" in out[5].reason and "vocabulary" in out[5].reason
    good = [0, 1, 4]
    rm = reward_model.scores([reward_model.token_ids(rollouts[i]) for i in good])
    ref = reference.logprobs([rollouts[i] for i in good])
    for k, (i, fn_reward) in enumerate(zip(good, (1.0, 0.0, 1.0), strict=True)):
        s = out[i]
        validate(s)
        assert s.scorer_id == "scorer-t" and s.rollout == rollouts[i]
        assert s.reward_components == pytest.approx({"reward_fn": 0.5 * fn_reward, "reward_model": 2.0 * rm[k]})
        assert s.reward == pytest.approx(0.5 * fn_reward + 2.0 * rm[k])
        np.testing.assert_allclose(s.ref_logprobs, ref[k], atol=1e-6)
        assert set(s.timings) == {"reward_fn_s", "reward_model_s", "ref_logprobs_s", "score_s", "created_at"}
    np.testing.assert_allclose(out[0].token_rewards, [0, 0, 0.5 + 2.0 * rm[0]], rtol=1e-6)
    np.testing.assert_allclose(out[4].token_rewards, [0.125, 0.125, 0.125 + 2.0 * rm[2]], rtol=1e-6)
    plain = score_rollouts(rollouts[:2], Scoring(scorer_id="scorer-t", reward_fn=poisonable_reward))
    assert [(p.reward, p.reward_components, p.token_rewards, p.ref_logprobs) for p in plain] == \
        [(1.0, {"reward_fn": 1.0}, None, None), (0.0, {"reward_fn": 0.0}, None, None)]


def test_load_scoring_reads_models_from_directories(tmp_path, policy, classifier):
    from stream_rl.demo.tokenizer import build_tokenizer
    from stream_rl.models.loading import save_model

    tokenizer = build_tokenizer()
    save_model(policy, tokenizer, tmp_path / "ref")
    save_model(classifier, tokenizer, tmp_path / "rm")
    cfg = ScorerConfig(reward_fn="consumers.scorer.builtin_rewards:exact_match", reference_model_dir=tmp_path / "ref",
                       reward_model_dir=tmp_path / "rm", batch_size=2)
    scoring = load_scoring(cfg, "scorer-dir")
    rollouts = [make_rollout(0), make_rollout(1, prompt_ids=(1, 4, 4, 13, 5, 14), response_ids=(6, 2))]
    out = score_rollouts(rollouts, scoring)
    for r, s in zip(rollouts, out, strict=True):
        np.testing.assert_allclose(s.ref_logprobs, manual_ref_logprobs(policy, r), atol=1e-5)
        direct = RewardModelScorer(classifier).scores([np.concatenate([r.prompt_token_ids, r.response_token_ids])])
        assert s.reward_components["reward_model"] == pytest.approx(direct[0], abs=1e-5)


# ---------------------------------------------------------------- the loop on the real broker












@pytest.mark.broker
def test_loop_scores_keyed_by_group_continues_traces_and_a_restart_rereads_nothing(make_config):
    cfg = make_config(**{"topics.partitions": {"rollouts": 2, "scored": 2}})
    t = Transport(cfg, "test", tracing=Tracing("producer-test"))
    t.ensure_topics()
    first_batch = group_rollouts(0, 3)
    send_rollouts(t, first_batch)
    exporter = InMemorySpanExporter()
    scfg = ScorerConfig(reward_fn="consumers.scorer.builtin_rewards:exact_match", batch_size=5, poll_timeout_s=0.3)
    scorer = ScorerThread(cfg, scfg, Tracing("scorer-test", exporter))
    scored = wait_for(lambda: (s := read_records(t, t.names.scored, "scored_rollout")) and len(s) >= 12 and s, "12 scored rollouts", 40, watch=[scorer])
    stats = scorer.finish()
    assert stats.scored == 12 and stats.rejected == 0 and stats.commits >= 1 and stats.lost_commits == 0
    assert sorted(s.value.rollout_id for s in scored) == sorted(r.rollout_id for r in first_batch)
    for s in scored:
        assert s.key == s.value.group_id.encode()
        assert s.value.reward == (1.0 if s.value.rollout.sample_index % 2 == 0 else 0.0)
        assert s.value.scorer_id.startswith("scorer-")
    assert len({(s.value.group_id, s.partition) for s in scored}) == 3  # each group on one partition
    # each scored record continues its rollout's trace; its "process score" span is the rollout send's child
    sent = {r.value.rollout_id: r.headers for r in read_records(t, t.names.rollouts, "rollout")}
    assert all(trace_id(s.headers) == trace_id(sent[s.value.rollout_id]) for s in scored)
    send_span_ids = {dict(h)["traceparent"].decode().split("-")[2] for h in sent.values()}
    per_record = [sp for sp in exporter.get_finished_spans() if sp.name == "process score"]
    assert len(per_record) == 12 and {f"{sp.parent.span_id:016x}" for sp in per_record} == send_span_ids
    check_role_telemetry(cfg, t, "scorer", topic_in=t.names.rollouts, records_in=12, topic_out=t.names.scored,
                         records_out=12, tokens=sum(r.response_length for r in first_batch), stage="score",
                         batches=stats.batches)
    instance, _ = only_export(cfg.run_dir)
    assert heartbeats(t, instance)[-1].step == stats.batches  # heartbeats report the batch counter

    # restart in the same group: only the new rollouts are scored, nothing committed before is read again
    scorer = ScorerThread(cfg, scfg)
    second_batch = group_rollouts(10, 1)
    send_rollouts(t, second_batch)
    wait_for(lambda: len(read_records(t, t.names.scored, "scored_rollout")) >= 16, "4 more scored rollouts", 40, watch=[scorer])
    time.sleep(1.0)
    stats = scorer.finish()
    assert stats.scored == 4
    ids = [s.value.rollout_id for s in read_records(t, t.names.scored, "scored_rollout")]
    assert sorted(ids) == sorted(r.rollout_id for r in first_batch + second_batch)


@pytest.mark.broker
def test_nan_reward_sends_that_rollout_to_the_dlq_and_scores_the_others(make_config):
    cfg = make_config(**{"topics.partitions": {"rollouts": 2, "scored": 2, "dlq": 1}})
    t = Transport(cfg, "test")
    t.ensure_topics()
    rollouts = group_rollouts(0, 2)
    poisoned = [make_rollout(5, 0, metadata={"poison": "nan"}), make_rollout(5, 1, metadata={"poison": "nan"})]
    acks = send_rollouts(t, rollouts + poisoned)
    sink = t.sink()
    sink.send_raw(t.names.rollouts, b"\xc1not msgpack", key=b"junk", partition=0)
    sink.flush()
    sink.close()
    scorer = ScorerThread(cfg, ScorerConfig(reward_fn=f"{THIS}:poisonable_reward", batch_size=4,
                                            poll_timeout_s=0.3))
    wait_for(lambda: len(read_records(t, t.names.scored, "scored_rollout")) >= 8
             and len(read_records(t, t.names.dlq, "dead_letter")) >= 3, "8 scored and 3 dead letters", 40, watch=[scorer])
    stats = scorer.finish()
    assert (stats.scored, stats.rejected) == (8, 2)
    scored = read_records(t, t.names.scored, "scored_rollout")
    assert sorted(s.value.rollout_id for s in scored) == sorted(r.rollout_id for r in rollouts)
    letters: list[DeadLetter] = [d.value for d in read_records(t, t.names.dlq, "dead_letter")]
    reward_letters = [d for d in letters if d.error_type == "RewardValueError"]
    assert len(reward_letters) == 2 and len(letters) == 3
    where = {(a.partition, a.offset) for a in acks[-2:]}
    assert {(d.source_partition, d.source_offset) for d in reward_letters} == where
    for d in reward_letters:
        assert "non-finite reward nan" in d.reason and d.source_topic == t.names.rollouts
        assert decode(d.raw_value, "rollout") in poisoned and d.raw_key == poisoned[0].group_id.encode()


@pytest.mark.broker
def test_two_scorers_in_one_group_score_every_rollout_exactly_once(make_config):
    cfg = make_config(**{"topics.partitions": {"rollouts": 4, "scored": 4}})
    t = Transport(cfg, "test")
    t.ensure_topics()
    scfg = dict(reward_fn="consumers.scorer.builtin_rewards:exact_match", batch_size=4, poll_timeout_s=0.3)
    scorers = [ScorerThread(cfg, ScorerConfig(scorer_id=name, **scfg)) for name in ("scorer-a", "scorer-b")]

    # let the group settle: warm-up rollouts on every partition until both scorers have scored some
    rounds = itertools.count()

    def both_settled():
        first = 1000 + 4 * next(rounds)
        for partition in range(4):
            send_rollouts(t, [make_rollout(first + partition)], partition=partition)
        time.sleep(1.0)
        return {s.value.scorer_id for s in read_records(t, t.names.scored, "scored_rollout")} == {"scorer-a",
                                                                                                  "scorer-b"}
    wait_for(both_settled, "both scorers to own partitions", 45, watch=scorers)

    main = group_rollouts(4, 10)  # groups q4..q13 hash onto all four partitions
    acks = send_rollouts(t, main)
    assert {a.partition for a in acks} == {0, 1, 2, 3}  # the groups cover every partition
    main_ids = {r.rollout_id for r in main}
    wait_for(lambda: main_ids <= {s.value.rollout_id for s in read_records(t, t.names.scored, "scored_rollout")}, "every rollout scored", 40, watch=scorers)
    time.sleep(1.0)
    for scorer in scorers:
        scorer.finish()
    scored = [s for s in read_records(t, t.names.scored, "scored_rollout") if s.value.rollout_id in main_ids]
    counts = Counter(s.value.rollout_id for s in scored)
    assert set(counts) == main_ids and set(counts.values()) == {1}, counts.most_common(3)
    by_scorer = Counter(s.value.scorer_id for s in scored)
    assert set(by_scorer) == {"scorer-a", "scorer-b"}, by_scorer  # the work was shared
    partition_of = {r.rollout_id: a.partition for r, a in zip(main, acks, strict=True)}
    owners = {}
    for s in scored:
        owners.setdefault(partition_of[s.value.rollout_id], set()).add(s.value.scorer_id)
    assert all(len(names) == 1 for names in owners.values()), owners  # one owner per partition


@pytest.mark.broker
def test_score_max_batches_counts_a_batch_of_dead_letters_only(make_config, broker, run_name, tmp_path):
    """Issue 13: `stream-rl score --max-batches 1` on a topic holding only undecodable records waited forever;
    a poll whose records were all dead-lettered is a batch."""
    import os
    import subprocess

    cfg = make_config(**{"topics.partitions": {"rollouts": 1}})
    t = Transport(cfg, "test")
    t.ensure_topics()
    sink = t.sink()
    for i in range(3):
        sink.send_raw(t.names.rollouts, b"\xc1not msgpack %d" % i, key=b"junk", partition=0)
    sink.flush()
    sink.close()
    cmd = [sys.executable, "-m", "stream_rl.cli.main", "score", "--max-batches", "1", "-b", broker.bootstrap,
           "--run", run_name, "--set", "run.demo_dir=null", "--set", f"run_dir={tmp_path / 'run'}",
           "--set", "scorer.poll_timeout_s=0.5"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAM_RL_")}
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=90, cwd=tmp_path, env=env)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError("score --max-batches 1 never ended on a batch of dead letters") from exc
    assert result.returncode == 0, result.stderr
    letters = read_records(t, t.names.dlq, "dead_letter")
    assert len(letters) == 3 and {d.value.source_offset for d in letters} == {0, 1, 2}
