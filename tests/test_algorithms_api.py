"""The public surface of stream_rl.algorithms: everything is exported, documented and free of module state."""

from __future__ import annotations

import ast
import inspect
import pathlib

import stream_rl.algorithms as algorithms

ISSUE_API = [
    "logprobs_from_logits", "entropy_from_logits", "discounted_returns", "gae", "grpo_advantages",
    "rloo_advantages", "reinforce_pp_advantages", "kl_penalty", "policy_loss", "value_loss",
    "AdaptiveKLController", "FixedKLController", "policy_lag", "max_lag_filter",
]
PACKAGE_DIR = pathlib.Path(algorithms.__file__).parent


def test_every_issue_function_is_exported():
    for name in ISSUE_API:
        assert name in algorithms.__all__, name
    for name in algorithms.__all__:
        assert hasattr(algorithms, name), name


def test_binding_signatures():
    """The positional parameters and defaults the issue specifies (extra keyword-only options are allowed)."""
    expected = {
        "logprobs_from_logits": ["logits", "labels"],
        "entropy_from_logits": ["logits"],
        "discounted_returns": ["token_rewards", "mask", "gamma"],
        "gae": ["token_rewards", "values", "mask", "gamma", "lam"],
        "grpo_advantages": ["rewards", "group_ids", "scale_by_std", "eps"],
        "rloo_advantages": ["rewards", "group_ids"],
        "reinforce_pp_advantages": ["token_rewards", "mask", "gamma"],
        "kl_penalty": ["logp", "ref_logp", "kind"],
        "policy_loss": ["logp", "old_logp", "advantages", "mask"],
        "value_loss": ["values", "old_values", "returns", "mask", "clip", "agg"],
        "AdaptiveKLController": ["init_coef", "target", "horizon"],
        "policy_lag": ["token_versions", "mask", "current_version"],
    }
    for name, names in expected.items():
        params = inspect.signature(getattr(algorithms, name)).parameters.values()
        positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert positional == names, name
    params = inspect.signature(algorithms.policy_loss).parameters
    defaults = {k: p.default for k, p in params.items() if p.kind is p.KEYWORD_ONLY}
    assert defaults == {"kind": "ppo", "clip_low": 0.2, "clip_high": 0.2, "dual_clip": None, "behavior_logp": None,
                        "is_cap": None, "is_mode": "clamp", "agg": "token-mean"}
    value_params = inspect.signature(algorithms.value_loss).parameters
    assert value_params["clip"].default == 0.2 and value_params["agg"].default == "token-mean"
    grpo_params = inspect.signature(algorithms.grpo_advantages).parameters
    assert grpo_params["scale_by_std"].default is True and grpo_params["eps"].default == 1e-6
    assert list(inspect.signature(algorithms.AdaptiveKLController.update).parameters) == [
        "self", "observed_kl", "n_steps"]


def test_every_public_function_states_a_formula_and_a_reference():
    for name in algorithms.__all__:
        obj = getattr(algorithms, name)
        if not callable(obj):
            continue
        doc = inspect.getdoc(obj) or ""
        module_doc = inspect.getdoc(inspect.getmodule(obj)) or ""
        assert doc, f"{name} has no docstring"
        text = doc + module_doc
        assert "=" in text, f"{name}: no formula"
        assert any(marker in text for marker in ("et al.", "Reference", "Schulman", "verl", "prime-rl")), name


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
