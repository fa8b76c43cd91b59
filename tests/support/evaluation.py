"""Evaluator test helpers: reward functions the tests name by reference, a held-out prompt file, the eval config."""

from __future__ import annotations

import json
from pathlib import Path


def even_length(prompt: str, response: str, answer: str | None, metadata: dict) -> float:
    """1.0 when the response has an even number of characters: a verifiable reward a random tiny model gets right
    about half the time."""
    return 1.0 if len(response) % 2 == 0 else 0.0


def write_prompts(path: Path, count: int = 6, sources: tuple[str, ...] = ("a",)) -> Path:
    """``count`` addition prompts (``1+1=``, ``2+1=``, ...), data sources taken round-robin from ``sources``."""
    rows = [{"prompt_id": f"e{i}", "text": f"{i}+1=", "answer": str(i + 1),
             "metadata": {"data_source": sources[i % len(sources)]}} for i in range(1, count + 1)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def eval_section(prompt_file: Path, **over) -> dict:
    """An ``eval`` section for the tests: one set ``heldout``, n=4, k=[1, 2], greedy, 4 new tokens."""
    base = {"sets": {"heldout": str(prompt_file)}, "n": 4, "k": [1, 2], "greedy": True, "max_new_tokens": 4,
            "every_versions": 2, "reward_fn": "support.evaluation:even_length", "batch_size": 4,
            "poll_timeout_s": 0.2}
    base.update(over)
    return base


def text_reward(prompt: str, response: str, answer: str | None, metadata: dict) -> str:
    """A broken reward function: it returns the response text, not a number."""
    return response
