"""The scorer without a broker: reward references and values, the builtin rewards, reference log-probs, the reward
model, and the pure step (`score_rollouts`) with the models loaded from directories."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from support.messages import rollout_for_scoring
from support.scorer import llama_config, poisonable_reward
from transformers import LlamaForCausalLM, LlamaForSequenceClassification

from consumers.scorer.builtin_rewards import contains_answer, exact_match, last_number_match
from consumers.scorer.config import ScorerConfig
from consumers.scorer.reference import ReferenceLogprobs
from consumers.scorer.reward_model import RewardModelScorer
from stream_rl.rewards.contract import RewardFnError, RewardValueError, check_reward_value, load_reward_fn
from consumers.scorer.scoring import Rejected, Scoring, load_scoring, score_rollouts
from schemas import Rollout, ScoredRollout, validate

torch.set_num_threads(1)


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
    assert load_reward_fn("support.scorer:poisonable_reward") is poisonable_reward
    with pytest.raises(ValidationError, match="neither a built-in reward .* nor a 'module:function' reference"):
        ScorerConfig(reward_fn="not-a-reference")
    with pytest.raises(ValidationError, match="exactly one ':'"):
        ScorerConfig(reward_fn="not:a:reference")
    for short in ("exact_match", "gsm8k", "code_tests"):  # one registry of short names: they work here too
        assert ScorerConfig(reward_fn=short).reward_fn == short
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


def test_reference_logprobs_equal_a_manual_forward_on_right_padded_batches(policy):
    rollouts = [rollout_for_scoring(0, prompt_ids=(1, 5, 6), response_ids=(7, 8, 9, 10, 2), temperature=1.0),
                rollout_for_scoring(1, prompt_ids=(1, 3, 4, 5, 6, 7, 8), response_ids=(11, 2), temperature=0.7),
                rollout_for_scoring(2, prompt_ids=(1,), response_ids=(4, 4, 9, 12, 13, 2), temperature=1.3),
                rollout_for_scoring(3, prompt_ids=(1, 9, 9, 9, 9), response_ids=(31,), temperature=1.0)]
    expected = [manual_ref_logprobs(policy, r) for r in rollouts]
    for batch_size in (3, 16):  # 3: chunks of 3 + 1 (the lone row keeps only its last logits); 16: one batch
        got = ReferenceLogprobs(policy, batch_size=batch_size).logprobs(rollouts)
        for r, g, e in zip(rollouts, got, expected, strict=True):
            assert g.dtype == np.float32 and g.shape == (r.response_length,)
            np.testing.assert_allclose(g, e, atol=1e-5, rtol=0)
            assert (g <= 0).all()
    # the temperature matters: the same tokens at T=1 give different values
    at_one = ReferenceLogprobs(policy).logprobs([rollout_for_scoring(1, prompt_ids=(1, 3, 4, 5, 6, 7, 8),
                                                              response_ids=(11, 2))])[0]
    assert np.abs(at_one - expected[1]).max() > 1e-3


def test_reference_rejects_what_it_cannot_score(policy):
    # 16-bit reference and reward models (scorer.dtype): tests/unit/test_scorer_precision.py
    ref = ReferenceLogprobs(policy)
    with pytest.raises(ValueError, match="response token id 40 is outside the reference model's vocabulary"):
        ref.check(rollout_for_scoring(0, response_ids=(3, 40)))
    with pytest.raises(ValueError, match="max_position_embeddings 32"):
        ref.check(rollout_for_scoring(0, prompt_ids=tuple(range(1, 31)), response_ids=(3, 4, 5)))


def test_reward_model_scores_are_finite_per_sequence_and_batch_invariant(classifier):
    from stream_rl.demo.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    rollouts = []
    for i, (prompt, response) in enumerate([("12+34=", "46"), ("5+5=", "10<eos>"), ("99+1=", "100")]):
        prompt_ids = tokenizer(prompt)["input_ids"]
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
        rollouts.append(rollout_for_scoring(i, prompt_ids=prompt_ids, response_ids=response_ids, prompt_text=prompt,
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
        by_tokens.token_ids(rollout_for_scoring(0, response_ids=(50,)))
    no_pad = LlamaForSequenceClassification(llama_config(num_labels=1))
    no_pad.config.pad_token_id = None
    with pytest.raises(ValueError, match="no pad_token_id"):
        RewardModelScorer(no_pad)


def test_step_combines_rewards_attaches_ref_logprobs_and_rejects_bad_records(policy, classifier):
    reference, reward_model = ReferenceLogprobs(policy), RewardModelScorer(classifier)
    scoring = Scoring(scorer_id="scorer-t", reward_fn=poisonable_reward, reward_fn_weight=0.5,
                      reward_model=reward_model, reward_model_weight=2.0, reference=reference,
                      token_level_rewards=True)
    rollouts = [rollout_for_scoring(0, response_text="7", answer="7"),                        # correct
                rollout_for_scoring(1, response_text="8", answer="7"),                        # wrong
                rollout_for_scoring(2, metadata={"poison": "nan"}),                            # NaN reward
                rollout_for_scoring(3, metadata={"poison": "raise"}),                          # reward fn raises
                rollout_for_scoring(4, metadata={"poison": "dense", "length": "3"}),           # token rewards
                rollout_for_scoring(5, response_ids=(3, 40))]                                 # not in the vocabulary
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
    rollouts = [rollout_for_scoring(0), rollout_for_scoring(1, prompt_ids=(1, 4, 4, 13, 5, 14), response_ids=(6, 2))]
    out = score_rollouts(rollouts, scoring)
    for r, s in zip(rollouts, out, strict=True):
        np.testing.assert_allclose(s.ref_logprobs, manual_ref_logprobs(policy, r), atol=1e-5)
        direct = RewardModelScorer(classifier).scores([np.concatenate([r.prompt_token_ids, r.response_token_ids])])
        assert s.reward_components["reward_model"] == pytest.approx(direct[0], abs=1e-5)
