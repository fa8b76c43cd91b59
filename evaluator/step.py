"""The evaluation step: one policy, every held-out set, generated, scored and summarised. No Kafka here.

Consumes: a loaded :class:`~producers.engines.base.GenerationEngine`, the sets (:func:`load_sets` reads each
``eval.sets`` file with the prompt loader, ``stream_rl.prompts.read_prompt_file``), the :class:`EvalConfig`, a
reward callable and an optional answer extractor (:mod:`stream_rl.evaluation.scoring`).
Produces: ``{"<set>/<metric>": value}`` (:mod:`stream_rl.evaluation.metrics`) plus ``<set>/reward_errors``.

Per set and batch of ``batch_size`` prompts::

    token ids (checked at load) -> engine.generate(n, temperature)      -> n responses per prompt
                                -> engine.generate(1, GREEDY) when eval.greedy (top_k = 1: the argmax)
    decode (skip special tokens) -> reward(prompt, response, answer, metadata); extract(response) for maj@k

Guarantees:
- The same weights and config give the same metrics: batch ``b`` of set ``s`` samples with a seed derived from
  ``eval.seed``, ``s`` and ``b`` only (never from the version), so two versions are compared on the same streams.
- Greedy decoding is sampling with :data:`GREEDY` (``top_k = 1``): only the argmax token can be drawn.
- Sampling uses the full tempered softmax (``eval.temperature``, no truncation), whatever ``producer`` sets.
- A prompt that cannot be generated for (untokenisable, too long for the model) is refused at load with an error
  naming the set, its file and its ``prompt_id``; a reward function that fails on one response counts that
  response as reward 0 and in ``reward_errors``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from producers.engines.base import SEED_MODULUS, GenerationEngine, Sampling
from evaluator.config import EvalConfig
from stream_rl.evaluation.metrics import DEFAULT_SOURCE, PromptOutcome, set_metrics
from stream_rl.evaluation.scoring import EvalRewardError, Extract, Reward
from stream_rl.prompts import PromptRow, read_prompt_file

GREEDY = Sampling(temperature=1.0, top_k=1)
"""Greedy decoding: the top-1 token of every step."""


@dataclass(frozen=True)
class EvalSet:
    """One held-out set: its name, file and rows (at most ``eval.max_prompts``)."""

    name: str
    path: Path
    rows: Sequence[PromptRow]


def set_options(data, policy_dir: Path | None):
    """The prompt loader's options for the eval sets, as ``stream-rl run`` loads its prompts: ``data`` (layout,
    column mapping, chat template; the shared section) with the policy's tokenizer (``policy_dir``: the engine's
    ``model_dir``), no dedup."""
    from stream_rl.prompts import check_options

    return check_options(data, policy_dir=policy_dir, dedup="none")


def load_sets(ecfg: EvalConfig, options=None) -> list[EvalSet]:
    """Every ``eval.sets`` file read and validated with the prompt loader (``options``: :func:`set_options`; None:
    its defaults); ``PromptFileError`` naming the file and line when one is invalid."""
    if not ecfg.sets:
        raise ValueError("eval.sets: name at least one held-out prompt file (name = \"path.jsonl\"), or use the "
                         "built demo (run.demo_dir), whose held-out split is the default")
    out = []
    for name, path in ecfg.sets.items():
        rows = read_prompt_file(Path(path), options)
        out.append(EvalSet(name, Path(path), rows[: ecfg.max_prompts] if ecfg.max_prompts else rows))
    return out


def tokenize_sets(sets: Sequence[EvalSet], engine: GenerationEngine, max_new_tokens: int) -> list[list[list[int]]]:
    """Token ids of every prompt of every set; ValueError naming ``eval.sets.<name>``, the file and prompt id."""
    out = []
    for s in sets:
        ids = []
        for row in s.rows:
            try:
                tokens = list(engine.tokenizer(row.text)["input_ids"])
            except Exception as exc:  # tokenizers raise plain Exception outside the vocabulary
                raise ValueError(f"eval.sets.{s.name} ({s.path}): prompt {row.prompt_id!r}: cannot tokenise: "
                                 f"{exc}") from exc
            if not tokens or len(tokens) + max_new_tokens > engine.max_model_len:
                raise ValueError(f"eval.sets.{s.name} ({s.path}): prompt {row.prompt_id!r}: {len(tokens)} tokens + "
                                 f"eval.max_new_tokens {max_new_tokens} do not fit max_model_len "
                                 f"{engine.max_model_len}")
            ids.append(tokens)
        out.append(ids)
    return out


def batch_seed(seed: int, set_name: str, batch: int) -> int:
    """The sampling seed of batch ``batch`` of set ``set_name``: a hash of the three."""
    digest = hashlib.sha256(f"stream-rl/eval/{seed}/{set_name}/{batch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % SEED_MODULUS


def evaluate_sets(engine: GenerationEngine, sets: Sequence[EvalSet], token_ids: Sequence[Sequence[list[int]]],
                  ecfg: EvalConfig, reward: Reward, extract: Extract | None) -> dict[str, float]:
    """The metrics of the engine's current weights on every set (see the module docstring)."""
    metrics: dict[str, float] = {}
    for s, ids in zip(sets, token_ids):
        outcomes, errors = [], 0
        for b, start in enumerate(range(0, len(s.rows), ecfg.batch_size)):
            rows, batch_ids = s.rows[start:start + ecfg.batch_size], ids[start:start + ecfg.batch_size]
            got, err = _batch(engine, rows, list(batch_ids), ecfg, reward, extract, batch_seed(ecfg.seed, s.name, b))
            outcomes += got
            errors += err
        metrics.update(set_metrics(s.name, outcomes, ecfg.k, ecfg.correct_at))
        metrics[f"{s.name}/reward_errors"] = float(errors)
    return metrics


def _batch(engine: GenerationEngine, rows: Sequence[PromptRow], ids: list[list[int]], ecfg: EvalConfig,
           reward: Reward, extract: Extract | None, seed: int) -> tuple[list[PromptOutcome], int]:
    groups = engine.generate(ids, ecfg.n, Sampling(temperature=ecfg.temperature), ecfg.max_new_tokens, seed)  # [B][n]
    greedy = engine.generate(ids, 1, GREEDY, ecfg.max_new_tokens, seed) if ecfg.greedy else None  # [B][1]
    decode = engine.tokenizer.decode
    outcomes, errors = [], 0
    for i, (row, group) in enumerate(zip(rows, groups)):
        texts = [decode(s.token_ids, skip_special_tokens=True) for s in group]
        scored = [_score(reward, row, t, len(s.token_ids)) for t, s in zip(texts, group)]
        greedy_reward = None
        if greedy is not None:
            top = greedy[i][0]
            g = _score(reward, row, decode(top.token_ids, skip_special_tokens=True), len(top.token_ids))
            scored.append(g)
            greedy_reward = g[0]
        errors += sum(1 for _, failed in scored if failed)
        outcomes.append(PromptOutcome(
            source=row.metadata.get(ecfg.source_key, DEFAULT_SOURCE), rewards=[r for r, _ in scored[:ecfg.n]],
            lengths=[len(s.token_ids) for s in group], finish_reasons=[s.finish_reason for s in group],
            answers=[extract(t) for t in texts] if extract is not None else [], greedy_reward=greedy_reward))
    return outcomes, errors


def _score(reward: Reward, row: PromptRow, response: str, length: int) -> tuple[float, bool]:
    """(reward, failed): a failing reward function counts as 0 and is reported in ``reward_errors``."""
    try:
        return reward(row.text, response, row.answer, row.metadata, length), False
    except EvalRewardError:
        return 0.0, True
