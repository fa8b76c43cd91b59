"""The demo's verifiable task: two-digit addition, `a+b=` -> the decimal digits of `a + b`.

Consumes: a count and a seed. Produces: prompt rows `{"prompt_id", "text", "answer"}` and a rule-based verifier.

Guarantees:
- Operands are 10..99, so there are 8,100 distinct problems. Each problem belongs to exactly one split, fixed by
  a hash of its text and independent of any seed: about 10% are held out for evaluation ("eval") and never
  appear in "train".
- `prompt_id` is derived from the problem alone (`add-12-34`, a valid schema id), so the same problem has the same id in every run.
- `make_prompts` draws without replacement; asking for more rows than a split holds raises `ValueError`.
- `addition_reward` is a pure function usable as the rule-based reward reference
  `stream_rl.demo.task:addition_reward`: 1.0 for an exact answer, else 0.0.
"""

from __future__ import annotations

import hashlib
import random
import re

REWARD_FUNCTION = "stream_rl.demo.task:addition_reward"
OPERANDS = range(10, 100)
EVAL_PERCENT = 10
SPLITS = ("train", "eval")
_PROMPT = re.compile(r"^(\d+)\+(\d+)=$")
_TRAILING_SPECIALS = re.compile(r"(?:<eos>|<pad>|\s)+$")


def split_of(a: int, b: int) -> str:
    """'eval' for about 10% of problems (by a hash of the text), else 'train'."""
    digest = hashlib.sha256(f"{a}+{b}=".encode()).digest()
    return "eval" if int.from_bytes(digest[:4], "big") % 100 < EVAL_PERCENT else "train"


def problems(split: str) -> list[tuple[int, int]]:
    """Every `(a, b)` of one split, in a fixed order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return [(a, b) for a in OPERANDS for b in OPERANDS if split_of(a, b) == split]


def make_prompts(n: int, seed: int, split: str = "train") -> list[dict]:
    """`n` distinct problems of `split`, shuffled by `seed`, as `{"prompt_id", "text", "answer"}` rows."""
    pool = problems(split)
    if not 0 <= n <= len(pool):
        raise ValueError(f"the {split} split holds {len(pool)} problems, {n} were asked for")
    chosen = random.Random(seed).sample(pool, n)
    return [{"prompt_id": f"add-{a}-{b}", "text": f"{a}+{b}=", "answer": str(a + b)} for a, b in chosen]


def answer_for(prompt: str) -> str:
    """The correct answer for an `a+b=` prompt; raises `ValueError` on any other text."""
    match = _PROMPT.match(prompt.strip())
    if match is None:
        raise ValueError(f"not an addition prompt: {prompt!r}")
    return str(int(match.group(1)) + int(match.group(2)))


def addition_reward(prompt: str, response: str, answer: str | None, metadata: dict) -> float:
    """1.0 if `response` is exactly the answer, else 0.0.

    Trailing `<eos>`/`<pad>` markers and whitespace are stripped first (responses may be decoded with or without
    special tokens); anything else, including text after an `<eos>`, makes the answer wrong. When `answer` is
    None it is computed from `prompt`. `metadata` is not used.
    """
    expected = answer if answer is not None else answer_for(prompt)
    return 1.0 if _TRAILING_SPECIALS.sub("", response) == expected else 0.0
