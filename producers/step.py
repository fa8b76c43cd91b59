"""The producer's pure step: prompts in, one group of sampled rollouts per prompt out. No Kafka.

Consumes: :class:`~schemas.Prompt` messages, a :class:`~producers.engines.base.GenerationEngine` and the
sampling settings. Produces: a :class:`StepResult` with the :class:`~schemas.Rollout` messages (prompt order,
then sample order), the prompts it could not use (with the reason, for the dead-letter topic) and metrics.

Guarantees:
- Every rollout has ``rollout_id = rollout_id_for(prompt_id, epoch, sample_index)`` and
  ``group_id = group_id_for(prompt_id, epoch)``: a regenerated sample has the id of the one it replaces.
- A group is complete: ``group_size`` rollouts with sample indices ``0..group_size-1``, where ``group_size`` is
  the override given or the prompt's own.
- ``token_policy_versions`` is, per token, the version that produced it: the sample's ``token_versions`` when the
  engine changed weights during the generation (in-flight updates), else the engine's version when the step began
  for every token. ``behavior_logprobs`` are the engine's sampled-distribution logprobs (``log softmax(logits /
  T)``, truncated and renormalised under top-k/top-p/min-p: :class:`~producers.engines.base.Sampling`) under those
  same weights. ``producer/policy_version`` is the version held when the step ends.
- The sampling seed of a batch is derived from ``seed`` and the batch's (group id, attempt) pairs: the same
  prompts and weights give the same rollouts, a re-queued attempt gets fresh randomness.
- Multi-turn (``turns``): each sample is an episode of policy and environment turns (:mod:`producers.multiturn`);
  the rollout carries ``policy_mask``, ``turns`` and the turns' texts joined by newlines as ``response_text``. A
  prompt whose environment raised is returned in ``rejected`` with the reason; the others are generated.
- A prompt that cannot be tokenised, is empty or too long, or asks for a group larger than ``max_group_size``,
  is returned in ``rejected`` with a reason (:func:`check_prompts`, before anything is generated); the other
  prompts of the batch are still generated.
- No batch barrier: with ``on_group`` each complete group is handed over once, from inside the decode loop when
  the engine streams groups (the hf engine), with the rollouts the result holds; the samples are those of a call
  without it. With ``early_stop`` (:func:`should_stop`) a batch stops decoding before its long tail ends; the cut
  groups are listed in ``StepResult.aborted`` (no partial rollout is returned) for the caller to re-queue, or,
  with ``EarlyStop.keep_partials``, their prefixes come back as ``StepResult.partials``
  (:class:`~schemas.PartialGroup`, :mod:`producers.partials`) for the caller to publish and resume.
- :func:`plan_batch` orders a polled batch so that rejected prompts are dead-lettered and committed before any
  generation that comes after them in their partition (a crash while generating never re-dead-letters them).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from producers.chat_turns import ChatTurns
from producers.engines.base import SEED_MODULUS, GenerationEngine, Sample, Sampling
from producers.environment import Environment
from producers.multiturn import Episode, run_episodes
from schemas import PartialGroup, Prompt, Rollout, group_id_for, rollout_id_for


GroupSink = Callable[[list[Rollout]], None]
"""``on_group(rollouts)``: one complete group (its ``group_size`` rollouts, in sample order)."""


@dataclass(frozen=True)
class Rejected:
    """A prompt the step could not generate for, and why (``index`` into the step's input)."""

    index: int
    reason: str


@dataclass(frozen=True)
class StepResult:
    """The rollouts of one step, the rejected prompts, the aborted ones (``index`` into the step's input: their
    groups were cut by :class:`EarlyStop`, nothing of them is in ``rollouts``), and metrics under ``producer/``."""

    rollouts: list[Rollout]
    rejected: list[Rejected] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    aborted: list[int] = field(default_factory=list)
    partials: list[PartialGroup] = field(default_factory=list)
    """With ``EarlyStop.keep_partials``: the prefixes of the aborted groups (one per index of ``aborted``, in that
    order), for the caller to publish instead of re-queuing the prompts."""
    dropped: list[Rejected] = field(default_factory=list)
    """Inputs whose work was dropped although nothing of them is lost (a stale partial group's prefix: its prompt
    is regenerated in ``rollouts``): the caller dead-letters each for the record (``StalePartial``)."""


@dataclass(frozen=True)
class EarlyStop:
    """When a generation may stop before its long tail ends (``producer.oversample``, ``producer.abort_after_s``;
    engines that cut groups: hf, in-process vLLM, servers). ``protected``: indices into the step's input that must
    end (prompts aborted before: each prompt is aborted at most once in a row, so every prompt is generated
    eventually)."""

    oversample: float = 0.0
    abort_after_s: float | None = None
    protected: frozenset[int] = frozenset()
    keep_partials: bool = False  # the cut groups' prefixes come back in StepResult.partials (producer.partial_max_lag)


def should_stop(ended: Sequence[bool], protected: Collection[int], oversample: float, elapsed_s: float,
                abort_after_s: float | None) -> bool:
    """Stop the decode loop of a batch of B groups (``ended[b]``: group b is complete) now?

    Yes iff every protected group has ended, at least one group has, and either ``#ended >= ceil(B / (1 +
    oversample))`` (with oversample > 0: the groups a version needs are in, the rest is the over-sampled tail) or
    ``elapsed_s >= abort_after_s``. A batch whose groups have all ended stops by itself (False here)."""
    done = sum(bool(e) for e in ended)
    if done == 0 or done == len(ended) or not all(ended[b] for b in protected):
        return False
    enough = oversample > 0 and done >= math.ceil(len(ended) / (1 + oversample))
    return enough or (abort_after_s is not None and elapsed_s >= abort_after_s)


def batch_seed(seed: int, prompts: Sequence[Prompt]) -> int:
    """The sampling seed of a batch: a hash of ``seed`` and each prompt's group id and attempt."""
    text = "|".join([str(seed)] + [f"{p.group_id}@{p.attempt}" for p in prompts])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") % SEED_MODULUS


def prompt_tokens(prompt: Prompt, engine: GenerationEngine, max_new_tokens: int) -> list[int]:
    """The prompt's token ids (its own, else the tokenised text); ValueError when it cannot be generated for."""
    if prompt.prompt_token_ids is not None:
        ids = [int(t) for t in prompt.prompt_token_ids]
    else:
        try:
            ids = list(engine.tokenizer(prompt.text)["input_ids"])
        except Exception as exc:  # tokenizers raise plain Exception for characters outside the vocabulary
            raise ValueError(f"cannot tokenise prompt text: {exc}") from exc
    if not ids:
        raise ValueError("prompt has no tokens")
    if len(ids) + max_new_tokens > engine.max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens; with max_new_tokens {max_new_tokens} that exceeds the "
                         f"model's {engine.max_model_len}")
    if min(ids) < 0 or max(ids) >= engine.vocab_size:
        raise ValueError(f"prompt token ids must lie in [0, {engine.vocab_size})")
    return ids


def check_group_size(prompt: Prompt, group_size: int | None, max_group_size: int | None) -> int:
    """The group size to generate for ``prompt``; ValueError when it exceeds ``max_group_size``."""
    n = group_size or prompt.group_size
    if max_group_size is not None and n > max_group_size:
        source = "producer.group_size" if group_size else "prompt group_size"
        raise ValueError(f"{source} {n} exceeds producer.max_group_size {max_group_size}")
    return n


def check_prompts(prompts: Sequence[Prompt], engine: GenerationEngine, *, max_new_tokens: int,
                  group_size: int | None = None,
                  max_group_size: int | None = None) -> tuple[list[tuple[int, Prompt, list[int]]], list[Rejected]]:
    """Split ``prompts`` into ``(index, prompt, token ids)`` that can be generated for and :class:`Rejected`."""
    accepted: list[tuple[int, Prompt, list[int]]] = []
    rejected: list[Rejected] = []
    for index, prompt in enumerate(prompts):
        try:
            check_group_size(prompt, group_size, max_group_size)
            accepted.append((index, prompt, prompt_tokens(prompt, engine, max_new_tokens)))
        except ValueError as exc:
            rejected.append(Rejected(index, str(exc)))
    return accepted, rejected


@dataclass(frozen=True)
class Turns:
    """Multi-turn settings: a factory of fresh environments (one per rollout), the policy turns at most, and the
    chat template that renders replies to conversational prompts (``data.chat_template``: None takes the
    tokenizer's own; :mod:`producers.chat_turns`)."""

    make_env: Callable[[], Environment]
    max_turns: int
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    use_chat: bool = True  # False: data.chat_template = "none", replies are plain text tokens

    def chat(self, tokenizer: Any) -> ChatTurns | None:
        """The reply renderer for ``tokenizer``; None when it has no chat template and none is given."""
        if not self.use_chat or (self.chat_template is None and not getattr(tokenizer, "chat_template", None)):
            return None
        return ChatTurns(tokenizer, self.chat_template, dict(self.chat_template_kwargs))


def produce_rollouts(prompts: Sequence[Prompt], engine: GenerationEngine, *, producer_id: str,
                     sampling: Sampling, max_new_tokens: int, seed: int, group_size: int | None = None,
                     max_group_size: int | None = None, clock: Callable[[], float] = time.time,
                     turns: Turns | None = None, on_group: GroupSink | None = None,
                     early_stop: EarlyStop | None = None) -> StepResult:
    """Sample one group per prompt with ``engine`` (multi-turn episodes with ``turns``: :mod:`producers.multiturn`)
    and wrap every sample as a :class:`Rollout`. With ``on_group`` every group's rollouts are handed to it once, as
    soon as the group is complete: from inside the decode loop when the engine streams groups
    (``engine.streams_groups``), else right after the generation of its group size. With ``early_stop`` (an
    engine that cuts groups: hf, in-process vLLM, servers; single-turn) the generation of each group size may stop before
    its tail ends (:func:`should_stop`); the groups cut there are listed in ``StepResult.aborted`` for the caller
    to re-queue (with ``EarlyStop.keep_partials`` their prefixes are in ``StepResult.partials``)."""
    started = clock()
    version = engine.version
    accepted, rejected = check_prompts(prompts, engine, max_new_tokens=max_new_tokens, group_size=group_size,
                                       max_group_size=max_group_size)
    by_size: dict[int, list[tuple[int, Prompt, list[int]]]] = {}
    for item in accepted:
        by_size.setdefault(group_size or item[1].group_size, []).append(item)
    groups: dict[int, list[Sample]] = {}  # prompt index -> its samples
    aborted: list[int] = []
    partials: dict[int, PartialGroup] = {}  # prompt index -> the prefixes of its cut group
    early: dict[int, list[Rollout]] = {}  # prompt index -> rollouts already handed to on_group

    def wrap(item: tuple[int, Prompt, list[int]], samples: list[Sample], generate_s: float,
             created_at: float) -> list[Rollout]:
        _, prompt, ids = item
        timings = {"generate_s": generate_s, "queue_wait_s": max(0.0, started - prompt.created_at),
                   "created_at": created_at}
        return [_rollout(prompt, ids, i, sample, group_size=len(samples), version=version, producer_id=producer_id,
                         temperature=sampling.temperature, tokenizer=engine.tokenizer, timings=timings)
                for i, sample in enumerate(samples)]

    def hand_over(item, samples: list[Sample], generate_s: float) -> None:
        early[item[0]] = wrap(item, samples, generate_s, clock())
        on_group(early[item[0]])

    def keep_cut(item, samples: list[Sample], running: list[bool]) -> None:
        partials[item[0]] = _partial(item, samples, running, version, producer_id)

    generate_s = 0.0
    for n, items in sorted(by_size.items()):
        t0 = time.perf_counter()
        hooks = _decode_hooks(engine, items, turns, early_stop, t0, spent_s=generate_s,
                              stream_to=hand_over if on_group is not None else None, cut_to=keep_cut)
        sampling_seed = batch_seed(seed, [p for _, p, _ in items])
        generated = _generate_groups(engine, items, n, sampling, max_new_tokens, sampling_seed, turns, hooks)
        generate_s += time.perf_counter() - t0
        for item in _file_groups(items, generated, groups, rejected, aborted):
            if on_group is not None and item[0] not in early:
                hand_over(item, groups[item[0]], generate_s)
    accepted = [item for item in accepted if item[0] in groups]
    created_at = clock()
    rollouts = [r for item in accepted
                for r in (early[item[0]] if item[0] in early else wrap(item, groups[item[0]], generate_s, created_at))]
    metrics = {**_metrics(rollouts, len(accepted), generate_s, engine.version), "producer/aborted": float(len(aborted))}
    return StepResult(rollouts, rejected, metrics, sorted(aborted), [partials[i] for i in sorted(aborted)
                                                                     if i in partials])


def _partial(item: tuple[int, Prompt, list[int]], samples: list[Sample], running: list[bool], version: int,
             producer_id: str) -> PartialGroup:
    from producers.partials import partial_group

    return partial_group(item[1], item[2], samples, running, version=version, producer_id=producer_id)


def _stop_when(early_stop: EarlyStop | None, items, t0: float) -> Callable[[list[bool]], bool] | None:
    """The engine's ``stop_when`` for the generation of ``items`` started at ``t0`` (None: run to the end)."""
    if early_stop is None or (early_stop.oversample == 0 and early_stop.abort_after_s is None):
        return None
    protected = [pos for pos, item in enumerate(items) if item[0] in early_stop.protected]
    return lambda ended: should_stop(ended, protected, early_stop.oversample, time.perf_counter() - t0,
                                     early_stop.abort_after_s)


def _decode_hooks(engine: GenerationEngine, items, turns: Turns | None, early_stop: EarlyStop | None, t0: float,
                  *, spent_s: float, stream_to: Callable[[Any, list[Sample], float], None] | None,
                  cut_to: Callable[[Any, list[Sample], list[bool]], None]) -> dict[str, Callable[..., Any]]:
    """The decode-loop hooks for the generation of ``items`` started at ``t0`` (none for multi-turn episodes;
    ``engine.generate`` takes those it supports). ``on_group`` (an engine that streams groups, ``stream_to`` set)
    hands each complete group to ``stream_to(item, samples, generate_s)``, ``generate_s`` counting ``spent_s``
    before ``t0``; ``stop_when`` (an engine that cuts groups) applies ``early_stop``; ``on_cut``
    (``EarlyStop.keep_partials``) hands each cut group's samples to ``cut_to(item, samples, running)``."""
    if turns is not None:
        return {}
    hooks: dict[str, Callable[..., Any]] = {}
    if stream_to is not None and getattr(engine, "streams_groups", False):
        hooks["on_group"] = lambda b, samples: stream_to(items[b], samples, spent_s + time.perf_counter() - t0)
    stop = _stop_when(early_stop, items, t0) if _cuts(engine) else None
    if stop is not None:
        hooks["stop_when"] = stop
        if early_stop is not None and early_stop.keep_partials:
            hooks["on_cut"] = lambda b, samples, running: cut_to(items[b], samples, running)
    return hooks


def _generate_groups(engine: GenerationEngine, items, n: int, sampling: Sampling, max_new_tokens: int, seed: int,
                     turns: Turns | None, hooks: dict[str, Callable[..., Any]]) -> list:
    """The groups of ``items`` (a list of samples per prompt, or a multi-turn failure's reason)."""
    ids = [ids for _, _, ids in items]
    if turns is not None:
        return run_episodes(engine, [p for _, p, _ in items], ids, n, sampling=sampling,
                            max_new_tokens=max_new_tokens, seed=seed, make_env=turns.make_env,
                            max_turns=turns.max_turns, chat=turns.chat(engine.tokenizer))
    return engine.generate(ids, n, sampling, max_new_tokens, seed, **hooks)


def _file_groups(items, generated: list, groups: dict[int, list[Sample]], rejected: list[Rejected],
                 aborted: list[int]) -> list:
    """File each generated group of ``items``: a multi-turn failure's reason in ``rejected``, a group cut by
    ``early_stop`` (empty) in ``aborted``, a complete one in ``groups``. Returns the items whose groups are complete."""
    complete = []
    for item, group in zip(items, generated, strict=True):
        if isinstance(group, str):  # its environment failed: dead-lettered with the reason
            rejected.append(Rejected(item[0], group))
        elif not group:  # cut by early_stop
            aborted.append(item[0])
        else:
            groups[item[0]] = group
            complete.append(item)
    return complete


def _cuts(engine: GenerationEngine) -> bool:
    """Whether ``engine`` can stop a generation before its long tail ends (``stop_when``: hf, in-process vLLM, servers)."""
    return bool(getattr(engine, "cuts_groups", False))


def _rollout(prompt: Prompt, prompt_ids: list[int], sample_index: int, sample: Sample, *, group_size: int,
             version: int, producer_id: str, temperature: float, tokenizer, timings: dict[str, float]) -> Rollout:
    length = len(sample.token_ids)
    return Rollout(
        rollout_id=rollout_id_for(prompt.prompt_id, prompt.epoch, sample_index),
        prompt_id=prompt.prompt_id, epoch=prompt.epoch, group_id=group_id_for(prompt.prompt_id, prompt.epoch),
        sample_index=sample_index, group_size=group_size,
        prompt_token_ids=np.asarray(prompt_ids, dtype=np.int32),
        response_token_ids=np.asarray(sample.token_ids, dtype=np.int32),
        # log 1 may round to a tiny positive float; the wire format requires <= 0
        behavior_logprobs=np.minimum(np.asarray(sample.logprobs, dtype=np.float32), np.float32(0.0)),
        token_policy_versions=(np.full(length, version, dtype=np.int64) if sample.token_versions is None
                               else np.asarray(sample.token_versions, dtype=np.int64)),
        finish_reason=sample.finish_reason, producer_id=producer_id, prompt_text=prompt.text,
        answer=prompt.answer, attempt=prompt.attempt, temperature=temperature,
        metadata={**prompt.metadata, **(sample.env_metadata if isinstance(sample, Episode) else {})},
        timings=dict(timings), **_text_and_turns(sample, tokenizer))


def _text_and_turns(sample: Sample, tokenizer) -> dict[str, Any]:
    """The rollout's ``response_text``; for a multi-turn episode also its ``policy_mask`` and ``turns``."""
    if not isinstance(sample, Episode):
        return {"response_text": tokenizer.decode(sample.token_ids, skip_special_tokens=True)}
    return {"response_text": sample.response_text, "policy_mask": np.asarray(sample.policy_mask, dtype=np.uint8),
            "turns": [dict(t) for t in sample.turns]}


def _metrics(rollouts: list[Rollout], prompts: int, generate_s: float, version: int) -> dict[str, float]:
    tokens = sum(r.response_length for r in rollouts)
    return {
        "producer/prompts": float(prompts),
        "producer/rollouts": float(len(rollouts)),
        "producer/response_tokens": float(tokens),
        "producer/generate_s": generate_s,
        "producer/tokens_per_s": tokens / generate_s if generate_s > 0 else 0.0,
        "producer/response_length_mean": tokens / len(rollouts) if rollouts else 0.0,
        "producer/stop_fraction": (sum(r.finish_reason == "stop" for r in rollouts) / len(rollouts)
                                   if rollouts else 0.0),
        "producer/policy_version": float(version),
        # in-flight weight updates: versions that produced this step's tokens beyond the first, rollouts spanning two
        "producer/inflight_updates": float(len({v for r in rollouts for v in np.unique(r.token_policy_versions)
                                                .tolist()}) - 1) if rollouts else 0.0,
        "producer/mixed_version_fraction": (sum(r.min_policy_version != r.max_policy_version for r in rollouts)
                                            / len(rollouts) if rollouts else 0.0),
    }


@dataclass(frozen=True)
class BatchPlan:
    """What one loop iteration does with a polled batch (indices into it, in batch order).

    Either ``reject`` (dead-letter and commit at once, no generation) or ``generate`` is empty; ``carry`` is left
    for the next iteration, uncommitted."""

    generate: list[int]
    reject: list[int]
    carry: list[int]


def plan_batch(partitions: Sequence[Hashable], rejected: Collection[int]) -> BatchPlan:
    """Split a batch (``partitions[i]``: record i's partition, offsets ascending within one) into runs.

    Each partition's records form runs of accepted and rejected records. When any partition starts with a
    rejected run, this iteration takes the leading rejected run of every partition (dead letters, committed before
    anything is generated); otherwise it takes the leading accepted run of every partition. Everything after a
    taken run waits in ``carry``::

        partition 0:  R R A A R      reject iteration:   R R . . .   then generate: A A . then reject: R
        partition 1:  A A A          (nothing of p1)                  A A A
    """
    bad = set(rejected)
    order: dict[Hashable, list[int]] = {}
    for index, tp in enumerate(partitions):
        order.setdefault(tp, []).append(index)
    reject_first = any(indices[0] in bad for indices in order.values())
    taken: set[int] = set()
    for indices in order.values():
        if (indices[0] in bad) != reject_first:
            continue
        for index in indices:
            if (index in bad) != reject_first:
                break
            taken.add(index)
    take = sorted(taken)
    carry = [i for i in range(len(partitions)) if i not in taken]
    return BatchPlan(generate=[] if reject_first else take, reject=take if reject_first else [], carry=carry)
