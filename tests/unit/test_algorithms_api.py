"""The public surface of stream_rl.algorithms: everything is exported and free of module state, and the defaults
and argument orders behave as docs/algorithms.md says."""

from __future__ import annotations

import ast
import math
import pathlib

import pytest
import torch

import stream_rl.algorithms as algorithms

ISSUE_API = [
    "logprobs_from_logits", "entropy_from_logits", "discounted_returns", "gae", "grpo_advantages",
    "rloo_advantages", "reinforce_pp_advantages", "kl_penalty", "policy_loss", "value_loss",
    "AdaptiveKLController", "FixedKLController", "policy_lag", "max_lag_filter",
    "aggregate", "loss_normaliser", "kl_loss", "importance_weights", "whiten_advantages",
]
PACKAGE_DIR = pathlib.Path(algorithms.__file__).parent


def test_every_issue_function_is_exported():
    for name in ISSUE_API:
        assert name in algorithms.__all__, name
    for name in algorithms.__all__:
        assert hasattr(algorithms, name), name


def test_policy_loss_defaults_are_ppo_with_a_symmetric_0_2_clip_and_a_token_mean():
    # ratios [1.3, 0.7 | 1.0] against A [1, -1 | 2]: clipped at 1.2 and 0.8 -> per-token [-1.2, 0.8 | -2]; token mean
    # over 3 tokens = -2.4 / 3 = -0.8 (a sequence mean would give ((-1.2 + 0.8) / 2 - 2) / 2 = -1.1).
    logp = torch.log(torch.tensor([[1.3, 0.7], [1.0, 1.0]]))
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    loss, metrics = algorithms.policy_loss(logp, torch.zeros(2, 2), torch.tensor([[1.0, -1.0], [2.0, 0.0]]), mask)
    assert loss.item() == pytest.approx(-0.8, abs=1e-6)
    assert metrics["clipfrac"].item() == pytest.approx(2 / 3)
    assert "is_weight_mean" not in metrics and "dual_clipfrac" not in metrics  # no correction, no dual clip


def test_value_loss_defaults_clip_at_0_2_with_a_token_mean():
    # V = 0.5, old V = 0, R = 1: unclipped (0.5 - 1)^2 = 0.25, clipped V = 0.2 -> 0.64; 0.5 * max = 0.32 per token.
    values, mask = torch.full((1, 2), 0.5), torch.ones(1, 2, dtype=torch.bool)
    loss, metrics = algorithms.value_loss(values, torch.zeros(1, 2), torch.ones(1, 2), mask)
    assert loss.item() == pytest.approx(0.32) and metrics["vf_clipfrac"].item() == 1.0


def test_grpo_advantages_default_scales_by_the_bessel_std_plus_1e_6():
    out = algorithms.grpo_advantages(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]))
    expected = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(out, torch.tensor([-expected, expected]))


def test_positional_arguments_mean_what_the_docs_say():
    # kl_penalty(logp, ref_logp, kind): k1 = logp - ref_logp
    assert algorithms.kl_penalty(torch.tensor([[-1.0]]), torch.tensor([[-3.0]]), "k1").item() == 2.0
    # AdaptiveKLController(init_coef, target, horizon).update(observed_kl, n_steps): 0.1 * (1 + 0.2 * 50 / 100)
    controller = algorithms.AdaptiveKLController(0.1, 0.01, 100)
    assert controller.update(1.0, 50) == pytest.approx(0.11)
    # policy_lag(token_versions, mask, current_version); gae(token_rewards, values, mask, gamma, lam)
    lag = algorithms.policy_lag(torch.tensor([[3, 2]]), torch.ones(1, 2, dtype=torch.bool), 5)
    assert lag.tolist() == [3]
    adv, ret = algorithms.gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.5]]), torch.ones(1, 2), 0.5, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.5]]))  # R = [0.5, 1] minus V = 0.5
    torch.testing.assert_close(ret, torch.tensor([[0.5, 1.0]]))


def test_no_module_state_and_no_io():
    """No module-level assignment other than constants (UPPER_CASE) and no I/O calls anywhere in the package."""
    for path in PACKAGE_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    assert isinstance(target, ast.Name), path.name
                    assert target.id.isupper() or target.id == "__all__", f"{path.name}: module state {target.id}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in {"open", "print", "input"}, f"{path.name}: I/O call {node.func.id}"
            if isinstance(node, (ast.Global, ast.Nonlocal)):
                raise AssertionError(f"{path.name}: global/nonlocal statement")
