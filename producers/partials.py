"""Durable partial rollouts: the prefix of a cut group, kept on a topic and resumed on the current weights. No Kafka.

Consumes: the prefixes of a group whose batch stopped decoding before it ended (``producer.oversample``,
``producer.abort_after_s``; the engine's ``on_cut``), and :class:`~schemas.PartialGroup` records read back
from the run's partials topic. Produces: the :class:`~schemas.PartialGroup` of a cut group
(:func:`partial_group`), and for a batch of partial groups the :class:`~producers.step.StepResult` of their
complete groups (:func:`resume_partials`): ordinary :class:`~schemas.Rollout` records, one per sample.

How a group is resumed::

    prefix of sample i (cut):   t0 t1 t2 | versions 3 3 4      prompt + t0 t1 t2 -> engine.generate(n=1,
    continuation on weights v6:  u0 u1    | versions 6 6        max_new_tokens - 3) on the weights held now
    the rollout:                t0 t1 t2 u0 u1, logprobs of both, versions 3 3 4 6 6, finish reason of u
    a sample that had ended before the cut is kept whole (no generation)

Guarantees:
- A resumed rollout's ``response_token_ids``, ``behavior_logprobs`` and ``token_policy_versions`` are the
  prefix's followed by the continuation's (:func:`join`): each token keeps the version that produced it, so the
  trainer's off-policy correction sees the old versions of the prefix. Its ids are those of the group it
  completes (``rollout_id_for(prompt_id, epoch, i)``), so a group both resumed and regenerated (a crash between
  the partials' flush and the prompts' commit) is one group downstream (consumers drop duplicates by id).
- The continuation of a prefix of L tokens has at most ``max_new_tokens - L`` tokens: a resumed rollout is never
  longer than an uncut one. Resumed groups run to their end (they are never cut again: ``cuts`` stays 1).
- Bounded staleness (:func:`stale_reason`): a partial group whose oldest prefix token is more than
  ``producer.partial_max_lag`` versions behind the weights held is not resumed: it is dropped with the reason
  (``StepResult.dropped``, which the producer dead-letters as ``StalePartial``; ``producer/partials_stale`` and a
  log line) and its prompt regenerated from scratch with ``attempt + 1``, so nothing is lost.
- Resumption is plain continuation from token ids (``engine.generate`` with ``n = 1`` per cut sample), so any
  engine resumes: hf, in-process vLLM and servers (tested on each). Every engine cuts too: hf and in-process vLLM
  stop their decode loops, the server engine aborts the tail's requests on their servers and reads the prefixes from
  the aborted answers (:mod:`producers.engines.server_cut`); each hands the prefixes to ``on_cut``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from producers.engines.base import SEED_MODULUS, GenerationEngine, Sample, Sampling
from producers.step import Rejected, StepResult, _metrics, _rollout, produce_rollouts
from schemas import PartialGroup, Prompt, Rollout

log = logging.getLogger(__name__)


def partial_group(prompt: Prompt, prompt_ids: Sequence[int], samples: Sequence[Sample], running: Sequence[bool],
                  *, version: int, producer_id: str) -> PartialGroup:
    """The partial group of ``prompt`` cut with ``samples`` (their prefixes; ``running[i]``: sample i was still
    running) generated on ``version`` (each token's own version when the sample records them)."""
    versions = [s.token_versions if s.token_versions is not None else [version] * len(s.token_ids) for s in samples]
    return PartialGroup(
        group_id=prompt.group_id, prompt=prompt, prompt_token_ids=np.asarray(prompt_ids, dtype=np.int32),
        sample_lengths=np.asarray([len(s.token_ids) for s in samples], dtype=np.int32),
        token_ids=np.asarray([t for s in samples for t in s.token_ids], dtype=np.int32),
        # log 1 may round to a tiny positive float; the wire format requires <= 0
        behavior_logprobs=np.minimum(np.asarray([x for s in samples for x in s.logprobs], dtype=np.float32),
                                     np.float32(0.0)),
        token_policy_versions=np.asarray([v for vs in versions for v in vs], dtype=np.int64),
        finish_reasons=["cut" if run else s.finish_reason for s, run in zip(samples, running, strict=True)],
        cuts=1, producer_id=producer_id)


def prefixes(partial: PartialGroup) -> list[tuple[Sample, bool]]:
    """Each sample's prefix as a :class:`Sample` (versions per token) and whether it was cut (to be continued)."""
    ends = np.cumsum(partial.sample_lengths).tolist()
    out = []
    for i, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        reason = partial.finish_reasons[i]
        out.append((Sample(partial.token_ids[start:end].tolist(), partial.behavior_logprobs[start:end].tolist(),
                           "length" if reason == "cut" else reason,
                           partial.token_policy_versions[start:end].tolist()), reason == "cut"))
    return out


def join(prefix: Sample, continuation: Sample, version: int) -> Sample:
    """The sample made of ``prefix`` then ``continuation`` (generated on ``version``, or with its own per-token
    versions): tokens, logprobs and versions concatenated, the continuation's finish reason."""
    tail = continuation.token_versions if continuation.token_versions is not None else \
        [version] * len(continuation.token_ids)
    head = prefix.token_versions if prefix.token_versions is not None else [version] * len(prefix.token_ids)
    return Sample(list(prefix.token_ids) + list(continuation.token_ids),
                  list(prefix.logprobs) + list(continuation.logprobs), continuation.finish_reason,
                  [int(v) for v in head] + [int(v) for v in tail])


def stale_reason(partial: PartialGroup, version: int, max_lag: int) -> str | None:
    """Why ``partial`` must not be resumed on ``version`` (None: it may): its oldest prefix token is more than
    ``max_lag`` versions behind (``version - min_policy_version > max_lag``)."""
    lag = version - partial.min_policy_version
    if lag > max_lag:
        return (f"partial prefix lag {lag} > producer.partial_max_lag {max_lag} (oldest token v"
                f"{partial.min_policy_version}, weights v{version})")
    return None


def resume_seed(seed: int, partials: Sequence[PartialGroup]) -> int:
    """The sampling seed of a resumption: a hash of ``seed`` and each group's id, attempt and cut count."""
    text = "|".join([f"resume/{seed}"] + [f"{p.group_id}@{p.prompt.attempt}/{p.cuts}" for p in partials])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") % SEED_MODULUS


def resume_partials(partials: Sequence[PartialGroup], engine: GenerationEngine, *, producer_id: str,
                    sampling: Sampling, max_new_tokens: int, max_lag: int, seed: int,
                    clock: Callable[[], float] = time.time) -> StepResult:
    """The complete groups of ``partials``: each fresh enough group continued on ``engine``'s weights
    (:func:`join`), each stale one regenerated from scratch (``attempt + 1``). Metrics under ``producer/``:
    ``partials_resumed``, ``partials_stale``, ``partials_kept_tokens`` (prefix tokens kept) and
    ``partials_new_tokens`` (tokens generated to complete them)."""
    started, version = clock(), engine.version
    fresh, stale, dropped = [], [], []
    for index, partial in enumerate(partials):
        reason = stale_reason(partial, version, max_lag)
        if reason is None:
            fresh.append(partial)
        else:
            log.warning("dropped the partial group %s as stale: %s; its prompt is regenerated from scratch",
                        partial.group_id, reason)
            dropped.append(Rejected(index, f"stale partial group: {reason}; its prompt is regenerated from scratch"))
            stale.append(dataclasses.replace(partial.prompt, attempt=partial.prompt.attempt + 1,  # the group's size
                                             group_size=int(partial.sample_lengths.shape[0])))
    t0 = time.perf_counter()
    groups = _continue(fresh, engine, sampling, max_new_tokens, resume_seed(seed, fresh))
    generate_s = time.perf_counter() - t0
    rollouts: list[Rollout] = []
    for partial, samples in zip(fresh, groups, strict=True):
        timings = {"generate_s": generate_s, "queue_wait_s": max(0.0, started - partial.prompt.created_at),
                   "created_at": clock()}
        rollouts += [_rollout(partial.prompt, partial.prompt_token_ids.tolist(), i, sample,
                              group_size=len(samples), version=version, producer_id=producer_id,
                              temperature=sampling.temperature, tokenizer=engine.tokenizer, timings=timings)
                     for i, sample in enumerate(samples)]
    redone = (produce_rollouts(stale, engine, producer_id=producer_id, sampling=sampling,
                               max_new_tokens=max_new_tokens, seed=seed, group_size=None, clock=clock)
              if stale else StepResult([]))
    kept = sum(int(p.sample_lengths.sum()) for p in fresh)
    all_rollouts = rollouts + redone.rollouts
    metrics = {**_metrics(all_rollouts, len(fresh) + len(stale), generate_s, engine.version),
               "producer/partials_resumed": float(len(fresh)), "producer/partials_stale": float(len(stale)),
               "producer/partials_kept_tokens": float(kept),
               "producer/partials_new_tokens": float(sum(r.response_length for r in rollouts) - kept)}
    where = [i for i, p in enumerate(partials) if stale_reason(p, version, max_lag) is not None]
    rejected = [dataclasses.replace(r, index=where[r.index]) for r in redone.rejected]  # index into `partials`
    return StepResult(all_rollouts, rejected, metrics, dropped=dropped)


def _continue(partials: Sequence[PartialGroup], engine: GenerationEngine, sampling: Sampling, max_new_tokens: int,
              seed: int) -> list[list[Sample]]:
    """Each partial group's samples, the cut ones continued: one ``generate(n=1)`` call per remaining budget
    (the prefixes of one cut share their length, so one call per cut), the continuation of prefix i after
    ``prompt + prefix i``."""
    version = engine.version
    groups = [[sample for sample, _ in prefixes(p)] for p in partials]
    todo: dict[int, list[tuple[int, int]]] = {}  # remaining budget -> (group, sample) pairs to continue
    for g, partial in enumerate(partials):
        for i, (sample, cut) in enumerate(prefixes(partial)):
            if cut and max_new_tokens - len(sample.token_ids) >= 1:
                todo.setdefault(max_new_tokens - len(sample.token_ids), []).append((g, i))
    for budget, pairs in sorted(todo.items()):
        contexts = [partials[g].prompt_token_ids.tolist() + groups[g][i].token_ids for g, i in pairs]
        out = engine.generate(contexts, 1, sampling, budget, (seed + budget) % SEED_MODULUS)
        for (g, i), (continuation,) in zip(pairs, out, strict=True):
            groups[g][i] = join(groups[g][i], continuation, version)
    return groups
