"""Turning an agent's recorded calls into rollouts: one multi-turn rollout when the calls form a prefix chain,
separate single-turn rollouts sharing the episode's reward otherwise.

Consumes: an episode's :class:`~schemas.GatewayCall` records (in call order) and how it ended (the
:class:`~schemas.GatewayEpisode` record with outcome ``ended``), for every episode of one group.
Produces: the group's :class:`~schemas.Rollout` records (pure: no Kafka, no engine).

The prefix chain, for calls ``k`` and ``k+1`` with prompt ids ``P_k`` and sampled ids ``S_k``::

    P_k+1 = P_k + S_k + G_k     with G_k non-empty (the tool result or user message, rendered by the template)

When every consecutive pair chains, the episode is one rollout whose prompt is ``P_0`` and whose response is::

    S_0 | G_0 | S_1 | G_1 | ... | S_n          policy_mask 1 on every S_k, 0 on every G_k

Guarantees:
- Token-exact: the chain holds only when the agent's next prompt, re-rendered by the chat template from the
  messages the agent sent back, holds the sampled ids exactly (``P_k+1[:len(P_k)+len(S_k)] == P_k + S_k``). A
  re-tokenisation drift (the template rewrites the assistant turn, the agent edits the history, the decoded text
  tokenises differently, the agent drops messages) breaks the chain: the whole episode is then trained as separate
  turns, never on ids the policy did not sample or condition on.
- The policy's tokens keep their behaviour logprobs and versions; the gap tokens ``G_k`` get logprob 0, mask 0 and
  the version of the policy token before them (they change neither the oldest nor the newest version).
- A group's rollouts share its ``prompt_id`` (the group name) at epoch 0 and are numbered in episode order, then
  call order; each carries its episode's reward in ``metadata`` (:data:`REWARD_KEY`) when the agent gave one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from schemas import GatewayCall, GatewayEpisode, Rollout, group_id_for, rollout_id_for
from stream_rl.rewards.given import REWARD_KEY
SOURCE_KEY = "reward_source"
"""Rollout metadata key: ``agent`` (the reward is in :data:`REWARD_KEY`) or ``scorer`` (score the final state)."""
EPISODE_KEY, MODE_KEY = "episode_id", "gateway_mode"
"""Rollout metadata keys: the episode a rollout came from, and ``chain`` or ``turns`` (how it was assembled)."""


@dataclass(frozen=True)
class Ended:
    """An episode ready to publish: its calls in order and its end record."""

    episode_id: str
    calls: Sequence[GatewayCall]
    end: GatewayEpisode


def group_of(episode_id: str) -> str:
    """The group an episode belongs to: the part of its id before the last ``/`` (the id itself without one)."""
    head, sep, _ = episode_id.rpartition("/")
    return head if sep and head else episode_id


def chain_breaks(calls: Sequence[GatewayCall]) -> list[int]:
    """Indices ``k`` whose call ``k+1`` does not extend call ``k`` (empty: the calls form a prefix chain)."""
    breaks = []
    for k in range(len(calls) - 1):
        held = np.concatenate([calls[k].prompt_token_ids, calls[k].response_token_ids])
        following = calls[k + 1].prompt_token_ids
        if calls[k].endpoint != calls[k + 1].endpoint or len(following) <= len(held) \
                or not np.array_equal(following[:len(held)], held):
            breaks.append(k)
    return breaks


def chained_sample(calls: Sequence[GatewayCall]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                          list[dict[str, str]]]:
    """(response ids [R], logprobs [R], versions [R], policy mask [R], turns) of a chained episode."""
    ids, logprobs, versions, mask, turns = [], [], [], [], []
    for k, call in enumerate(calls):
        if k > 0:
            start = len(calls[k - 1].prompt_token_ids) + len(calls[k - 1].response_token_ids)
            gap = call.prompt_token_ids[start:]  # the messages added after the policy's turn: [G]
            ids.append(gap)
            logprobs.append(np.zeros(len(gap), np.float32))
            versions.append(np.full(len(gap), versions[-1][-1], np.int64))
            mask.append(np.zeros(len(gap), np.uint8))
            turns.append({"role": "env"})
        ids.append(call.response_token_ids)
        logprobs.append(call.behavior_logprobs)
        versions.append(call.token_policy_versions)
        mask.append(np.ones(len(call.response_token_ids), np.uint8))
        turns.append({"role": "policy", "finish_reason": call.finish_reason})
    return (np.concatenate(ids).astype(np.int32), np.concatenate(logprobs).astype(np.float32),
            np.concatenate(versions).astype(np.int64), np.concatenate(mask), turns)


def assemble_group(group: str, episodes: Sequence[Ended], producer_id: str, decode) -> list[Rollout]:
    """Every rollout of ``group`` (see the module guarantees); ``decode(ids) -> str`` gives prompt texts."""
    pieces: list[tuple[Ended, list[GatewayCall], bool]] = []
    for episode in episodes:
        chained = not chain_breaks(episode.calls)
        pieces += [(episode, list(episode.calls), True)] if chained else \
            [(episode, [call], False) for call in episode.calls]
    return [_rollout(group, index, len(pieces), episode, calls, chained, producer_id, decode)
            for index, (episode, calls, chained) in enumerate(pieces)]


def _rollout(group: str, index: int, size: int, episode: Ended, calls: list[GatewayCall], chained: bool,
             producer_id: str, decode) -> Rollout:
    first, last = calls[0], calls[-1]
    end = episode.end
    multi = len(calls) > 1
    if multi:
        ids, logprobs, versions, mask, turns = chained_sample(calls)
        text = decode(ids)
    else:
        ids, logprobs, versions = first.response_token_ids, first.behavior_logprobs, first.token_policy_versions
        mask, turns, text = None, None, first.response_text
    return Rollout(
        rollout_id=rollout_id_for(group, 0, index), prompt_id=group, epoch=0, group_id=group_id_for(group, 0),
        sample_index=index, group_size=size, prompt_token_ids=first.prompt_token_ids, response_token_ids=ids,
        behavior_logprobs=logprobs, token_policy_versions=versions, finish_reason=last.finish_reason,
        producer_id=producer_id, prompt_text=decode(first.prompt_token_ids), response_text=text,
        answer=end.answer, metadata=episode_metadata(episode.episode_id, end, chained), temperature=last.temperature,
        timings={"created_at": float(last.created_at)}, policy_mask=mask, turns=turns)


def episode_metadata(episode_id: str, end: GatewayEpisode, chained: bool) -> dict[str, str]:
    """The metadata of an episode's rollouts: the tags given at its end, the episode, the mode, the reward."""
    out = dict(end.metadata)
    out.update({EPISODE_KEY: episode_id, MODE_KEY: "chain" if chained else "turns",
                SOURCE_KEY: "scorer" if end.reward is None else "agent"})
    if end.reward is not None:
        out[REWARD_KEY] = json.dumps(float(end.reward))
    return out


def ordered_calls(calls: Mapping[int, GatewayCall]) -> list[GatewayCall]:
    """An episode's calls in call order (a restart may read a call recorded twice: it is kept once)."""
    return [calls[i] for i in sorted(calls)]
