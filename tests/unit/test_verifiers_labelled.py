"""The built-in verifiers against hand labels: tests/unit/fixtures/verifier_cases.jsonl, written for this project
(no peer's test data), of the shapes models write (chain of thought then a boxed / #### / "answer is" line, units,
thousands separators, signs, end markers, near misses, several answers, none, a refusal). Each case's ``label`` is
the careful human judgement (is the response's final answer the reference's answer), not what the code says.
Agreement per verifier must be at least 97 %; docs/rewards.md has the figures and how to measure them:
``python -m tests.unit.test_verifiers_labelled``."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from stream_rl.rewards.verifiers import VERIFIERS

CASES = Path(__file__).parent / "fixtures" / "verifier_cases.jsonl"
MIN_AGREEMENT = {"math_boxed": 0.97, "multiple_choice": 0.97, "gsm8k": 0.97}  # the goal of issue 40, each
"""gsm8k: 155/159 today; its 4 misses are the last-number rule's known blind spots (a count or year after the
answer, "2 000", "Step 2"), kept in the set on purpose (docs/rewards.md)."""
MIN_CASES = {"math_boxed": 200, "gsm8k": 90, "multiple_choice": 100}


def load_cases() -> list[dict]:
    return [json.loads(line) for line in CASES.read_text().splitlines() if line.strip()]


def disagreements(verifiers=VERIFIERS) -> tuple[dict[str, int], dict[str, list[str]]]:
    """Cases per verifier, and one line per case whose score differs from its label."""
    counts: dict[str, int] = defaultdict(int)
    wrong: dict[str, list[str]] = defaultdict(list)
    for case in load_cases():
        name = case["verifier"]
        counts[name] += 1
        score = verifiers[name].score(case["response"], case["answer"])
        if score != case["label"]:
            wrong[name].append(f"label {case['label']} score {score}: {case['note']}: "
                               f"response {case['response'][-120:]!r} answer {case['answer']!r}")
    return counts, wrong


@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_agreement_with_hand_labels(name):
    counts, wrong = disagreements()
    assert counts[name] >= MIN_CASES[name]
    agreement = 1 - len(wrong[name]) / counts[name]
    message = f"{name}: {agreement:.1%} agreement; disagreements:\n" + "\n".join(wrong[name])
    assert agreement >= MIN_AGREEMENT[name], message


def test_every_case_is_well_formed():
    for case in load_cases():
        assert set(case) == {"verifier", "response", "answer", "label", "note"}
        assert case["verifier"] in VERIFIERS and case["label"] in (0, 1) and case["note"]


def report(verifiers=VERIFIERS) -> str:
    counts, wrong = disagreements(verifiers)
    lines = [f"{name}: {counts[name] - len(wrong[name])}/{counts[name]} = "
             f"{1 - len(wrong[name]) / counts[name]:.1%}" for name in sorted(counts)]
    return "\n".join(lines + [f"  {name}: {line}" for name in sorted(wrong) for line in wrong[name]])


if __name__ == "__main__":
    print(report())
