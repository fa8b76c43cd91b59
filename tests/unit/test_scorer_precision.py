"""The scorer's device and dtype settings: 16-bit frozen models track float32, devices are checked and resolved."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from support.messages import rollout_for_scoring
from support.scorer import llama_config
from transformers import LlamaForCausalLM, LlamaForSequenceClassification

from consumers.scorer.config import ScorerConfig
from consumers.scorer.scoring import load_scoring, score_rollouts
from schemas import ScoredRollout
from stream_rl.cli.config import load_config
from stream_rl.config.base import ConfigError
from stream_rl.models import resolve_device

torch.set_num_threads(1)

ROLLOUTS = [rollout_for_scoring(0, prompt_ids=(1, 5, 6), response_ids=(7, 8, 9, 10, 2), temperature=1.0),
            rollout_for_scoring(1, prompt_ids=(1, 3, 4, 5, 6, 7, 8), response_ids=(11, 2), temperature=0.7),
            rollout_for_scoring(2, prompt_ids=(1,), response_ids=(4, 4, 9, 12, 13, 2), temperature=1.3),
            rollout_for_scoring(3, prompt_ids=(1, 9, 9, 9, 9), response_ids=(31, 17, 20, 21, 22, 23, 24), temperature=1.0)]

# Largest |16-bit - float32| over ROLLOUTS' 20 reference log-probs and 4 reward-model scores, measured on CPU
# (torch 2.13, transformers 5.19) for these seed-0 models: bfloat16 0.0151 (logp) and 0.00079 (score), float16
# 0.00225 and 0.00010; over seeds 0-9 of the same models at most 0.0285 / 0.0024 (bf16) and 0.0032 / 0.00022
# (fp16). The log-probs range over [-5.8, -2.7]: bf16 keeps 8 mantissa bits (relative error 2**-8 = 0.4 % of a
# logit), fp16 11. Each tolerance is 3x or more this seed's value and above the largest over seeds 0-9.
TOLERANCE = {"bfloat16": {"logp": 0.05, "score": 0.01}, "float16": {"logp": 0.01, "score": 0.001}}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A reference policy with a sharpened output head (log-probs far from uniform, as the producers' tiny
    model) and a one-label reward model, saved in float32 as the scorer loads them."""
    from stream_rl.demo.tokenizer import build_tokenizer
    from stream_rl.models import save_model

    root, tokenizer = tmp_path_factory.mktemp("scorer-precision"), build_tokenizer()
    torch.manual_seed(0)
    reference = LlamaForCausalLM(llama_config())
    with torch.no_grad():
        reference.lm_head.weight.mul_(8.0)
    torch.manual_seed(1)
    reward_model = LlamaForSequenceClassification(llama_config(num_labels=1))
    return save_model(reference, tokenizer, root / "ref"), save_model(reward_model, tokenizer, root / "rm")


def scoring_in(model_dirs, **settings):
    ref_dir, rm_dir = model_dirs
    cfg = ScorerConfig(reward_fn=None, reference_model_dir=ref_dir, reward_model_dir=rm_dir, batch_size=2, **settings)
    return load_scoring(cfg, "scorer-precision")


def ref_and_scores(scoring) -> tuple[np.ndarray, np.ndarray]:
    """All reference log-probs of ROLLOUTS concatenated [20], and the reward model's scores [4]."""
    logp = scoring.reference.logprobs(ROLLOUTS)
    assert all(lp.dtype == np.float32 for lp in logp)
    scores = scoring.reward_model.scores([scoring.reward_model.token_ids(r) for r in ROLLOUTS])
    assert all(isinstance(s, float) and float(np.float32(s)) == s for s in scores)  # float32 values
    return np.concatenate(logp), np.asarray(scores)


@pytest.fixture(scope="module")
def full_precision(model_dirs):
    return ref_and_scores(scoring_in(model_dirs))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_frozen_models_are_16_bit_and_track_float32(model_dirs, full_precision, dtype):
    scoring = scoring_in(model_dirs, dtype=dtype)
    for model in (scoring.reference.model, scoring.reward_model.model):
        params = list(model.parameters())
        assert {p.dtype for p in params} == {getattr(torch, dtype)}  # no float32 master copy of a frozen model
        assert not any(p.requires_grad for p in params)
    logp, scores = ref_and_scores(scoring)
    ref_logp, ref_scores = full_precision
    logp_err, score_err = np.abs(logp - ref_logp).max(), np.abs(scores - ref_scores).max()
    assert logp_err <= TOLERANCE[dtype]["logp"], logp_err
    assert score_err <= TOLERANCE[dtype]["score"], score_err
    assert logp_err > 1e-4  # the forward really ran in 16 bits (float32 agrees with itself to ~1e-6)
    assert (logp <= 0).all() and np.isfinite(logp).all()
    out = score_rollouts(ROLLOUTS, scoring)  # the step's own checks (finite, <= 0, schema) pass in 16 bits
    assert all(isinstance(o, ScoredRollout) and o.ref_logprobs.dtype == np.float32 for o in out)


def test_auto_is_the_default_and_resolves_to_the_gpu_only_when_torch_sees_one(model_dirs):
    expected = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert ScorerConfig().device == "auto" and ScorerConfig().dtype == "float32"
    assert resolve_device("auto", "scorer.device") == expected
    scoring = scoring_in(model_dirs)
    for model in (scoring.reference.model, scoring.reward_model.model):
        assert {p.device.type for p in model.parameters()} == {expected.type}
        assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert scoring.reference.device.type == scoring.reward_model.device.type == expected.type


def test_device_strings_are_checked_by_the_config_and_missing_gpus_when_loading(model_dirs):
    for good in ("auto", "cpu", "cuda", "cuda:1"):
        assert ScorerConfig(device=good).device == good
    for bad in ("gpu", "cuda:", "cuda:x", "CPU", "", "mps"):
        with pytest.raises(ValidationError, match="device"):
            ScorerConfig(device=bad)
    with pytest.raises(ConfigError, match=r"scorer\.device: String should match pattern .*\[from flag\]"):
        load_config(None, env={}, overrides={"scorer.device": "gpu"})
    with pytest.raises(ConfigError, match=r"scorer\.dtype"):
        load_config(None, env={}, overrides={"scorer.dtype": "float64"})
    with pytest.raises(ConfigError, match=r"scorer\.half_precision was removed: set scorer\.dtype"):
        load_config(None, env={}, overrides={"scorer.half_precision": "true"})
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="scorer.device='cuda:1' but torch sees no CUDA device"):
            scoring_in(model_dirs, device="cuda:1")
    # a scorer without models never touches a device: a rule-based reward alone loads anywhere
    assert load_scoring(ScorerConfig(device="cuda:7"), "scorer-precision").reference is None
