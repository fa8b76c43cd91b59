"""Evaluation metrics against hand-computed values (stream_rl.evaluation.metrics)."""

from __future__ import annotations

import math

import pytest

from stream_rl.evaluation.metrics import PromptOutcome, group_metrics, majority_correct, pass_at_k, set_metrics


def _binom_pass(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_pass_at_k_hand_values():
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(3, 1, 3) == 1.0  # n - c = 2 < k: every draw of 3 holds the correct one


def test_pass_at_k_product_equals_the_binomial_form():
    for n in range(1, 12):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_binom_pass(n, c, k), abs=1e-12)


def test_pass_at_k_is_stable_for_large_n():
    value = pass_at_k(1000, 3, 100)
    assert value == pytest.approx(_binom_pass(1000, 3, 100), rel=1e-9)


def test_k_above_n_is_an_error_naming_the_field():
    with pytest.raises(ValueError, match=r"eval\.k"):
        pass_at_k(4, 1, 5)


def test_majority_vote_ties_break_to_the_first_seen_answer():
    assert majority_correct(["3", "4", "3", None], [1, 0, 1, 0], 3, 1.0) == 1.0
    assert majority_correct(["3", "4", "4"], [1, 0, 0], 2, 1.0) == 1.0  # tie 3:1, 4:1 -> "3"
    assert majority_correct(["4", "3", "4"], [0, 1, 0], 3, 1.0) == 0.0
    assert majority_correct([None, None], [1, 1], 2, 1.0) is None


def _two_prompts(source_b: str = "s") -> list[PromptOutcome]:
    return [
        PromptOutcome("s", [1, 0, 1, 0], [2, 3, 4, 5], ["stop", "stop", "length", "stop"], ["7", "8", "7", "9"], 1.0),
        PromptOutcome(source_b, [0, 0, 0, 1], [1, 1, 1, 1], ["stop", "stop", "length", "stop"], [], 0.0),
    ]


def test_group_metrics_hand_computed():
    got = group_metrics(_two_prompts(), [1, 2], correct_at=1.0)
    assert got == pytest.approx({
        "prompts": 2.0,
        "mean@4": (0.5 + 0.25) / 2,
        "pass@1": (0.5 + 0.25) / 2,
        "pass@2": ((1 - 1 / 6) + (1 - 3 / 6)) / 2,
        "maj@1": 1.0,  # only prompt 1 has answers; its first answer "7" is correct
        "maj@2": 1.0,  # tie "7"/"8" -> "7"
        "greedy/accuracy": 0.5,
        "greedy/reward": 0.5,
        "length/mean": 18 / 8,
        "finish/length": 2 / 8,
        "finish/stop": 6 / 8,
    })


def test_correct_at_threshold_counts_partial_rewards():
    outcome = [PromptOutcome("s", [0.5, 0.9], [1, 1], ["stop", "stop"])]
    assert group_metrics(outcome, [1], correct_at=0.9)["pass@1"] == 0.5
    assert group_metrics(outcome, [1], correct_at=0.4)["pass@1"] == 1.0


def test_set_metrics_split_by_source_only_when_several():
    one = set_metrics("heldout", _two_prompts(), [1], 1.0)
    assert all(key.count("/") == 1 or key.startswith(("heldout/greedy", "heldout/finish", "heldout/length"))
               for key in one)
    two = set_metrics("heldout", _two_prompts("t"), [1], 1.0)
    assert two["heldout/s/pass@1"] == 0.5 and two["heldout/t/pass@1"] == 0.25
    assert two["heldout/pass@1"] == pytest.approx(0.375)
    assert two["heldout/t/prompts"] == 1.0


def test_unequal_sample_counts_and_empty_sets_are_refused():
    with pytest.raises(ValueError, match="n = 2"):
        group_metrics([PromptOutcome("s", [1, 0], [1, 1], ["stop", "stop"]),
                       PromptOutcome("s", [1], [1], ["stop"])], [1], 1.0)
    with pytest.raises(ValueError, match=r"eval\.sets\.x"):
        set_metrics("x", [], [1], 1.0)
