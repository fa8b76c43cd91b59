"""The gateway's work behind its HTTP endpoints: sample for a call, record it, end an episode, publish its group.

Consumes: a :class:`~producers.engines.base.GenerationEngine` (the current policy), a
:class:`~stream_rl.transport.sink.Sink`, the run's topic names, the ``gateway`` section and the producer's
sampling settings and token budget; requests already read by :mod:`producers.gateway.calls`.
Produces: per call a :class:`~schemas.GatewayCall` on the gateway topic (key ``episode_id``) and the OpenAI
answer; per episode end a :class:`~schemas.GatewayEpisode`; per complete group its
:class:`~schemas.Rollout` records on the rollouts topic (key ``group_id``, where the producers' rollouts go, so the
scorer and trainer consume them unchanged); per dead episode a :class:`~schemas.DeadLetter` on the dlq topic;
the counters its heartbeat reports (:meth:`Gateway.metrics`).

Guarantees:
- Recorded before answered: a call is answered only after its record was acknowledged by the broker (flush),
  so a gateway that restarts loses no call an agent saw answered (:meth:`Gateway.replay` rebuilds the book).
- One lock serialises the engine, the sink and the book: engines are not thread-safe, and concurrent episodes
  never mix (every record and rollout is built from one episode's own calls, keyed by its id).
- Publishing order: rollouts acknowledged, then the ``published`` records; a crash between the two publishes the
  group again at restart under the same rollout ids (the scorer and trainer drop duplicates by id).
- A dead episode (idle past ``gateway.episode_timeout_s``, or ended by its agent as failed) gets a dead letter
  with its reason, pointing at its first call's record, and is never trained. An episode ended as failed before
  its first call (its agent died starting) is dead-lettered too, its letter pointing at its ``dead_lettered``
  record, so its group does not wait for it.
- Refills: an episode ended as failed with ``refill`` is dead-lettered the same way but not counted in its group
  (:class:`~producers.gateway.book.Book`), which waits for a replacement; a replacement that does not start within
  ``gateway.episode_timeout_s`` is given up on by :meth:`Gateway.sweep` (a second ``dead_lettered`` record, no
  second letter), so the group then publishes from the others.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from producers.chat_turns import ChatTurns
from producers.engines.base import SEED_MODULUS, GenerationEngine, Sampling
from producers.gateway.book import Book
from producers.gateway.calls import (
    CallRequest, RequestError, chat_answer, completion_answer, read_request, usage_of,
)
from producers.gateway.config import GatewayConfig
from producers.gateway.episodes import assemble_group, group_of
from producers.multiturn import turn_sampling
from schemas import DeadLetter, GatewayCall, GatewayEpisode, SchemaError, decode, encode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topics:
    """The full names of the topics the gateway writes."""

    gateway: str
    rollouts: str
    dlq: str


class Gateway:
    """The endpoints' work (module docstring); every public method takes the lock."""

    def __init__(self, engine: GenerationEngine, sink, topics: Topics, gcfg: GatewayConfig, sampling: Sampling,
                 budget: int, producer_id: str, renderer, chat: ChatTurns):
        self.engine, self.sink, self.topics, self.gcfg = engine, sink, topics, gcfg
        self.sampling, self.budget, self.producer_id = sampling, budget, producer_id
        self.renderer, self.chat = renderer, chat  # stream_rl.prompts.render.ChatRenderer, producers.chat_turns
        self.book = Book(gcfg.group_size)
        self.tool_format = tool_format_of(gcfg.tool_format, renderer, engine.tokenizer)
        self.lock = threading.Lock()
        self.calls = self.tokens = 0  # calls answered and tokens sampled since the process started

    # -- calls ------------------------------------------------------------------------------------------------------

    def call(self, endpoint: str, episode_id: str, body: Any) -> dict[str, Any]:
        """Sample one answer for ``episode_id``, record it, and return the OpenAI answer object."""
        request = read_request(body, endpoint, self.gcfg.model_name, self.budget)
        with self.lock:
            index = self._check_open(episode_id)
            prompt_ids = self._prompt_ids(request)
            sampling = self._sampling(request)
            seed = _seed(episode_id, index)
            sample = self.engine.generate([prompt_ids], 1, sampling, request.max_tokens, seed)[0][0]
            versions = sample.token_versions or [self.engine.version] * len(sample.token_ids)
            text = self.engine.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
            call = GatewayCall(
                episode_id=episode_id, call_index=index, endpoint=endpoint, messages_json=json.dumps(request.sent),
                tools_json=None if request.tools is None else json.dumps(request.tools),
                prompt_token_ids=np.asarray(prompt_ids, np.int32),
                response_token_ids=np.asarray(sample.token_ids, np.int32),
                behavior_logprobs=np.minimum(np.asarray(sample.logprobs, np.float32), 0.0),
                token_policy_versions=np.asarray(versions, np.int64), finish_reason=sample.finish_reason,
                temperature=sampling.temperature, response_text=text)
            self.sink.send(self.topics.gateway, call, key=episode_id)
            self.book.add_call(call, _where(self.sink.flush()))
            self.calls += 1
            self.tokens += len(sample.token_ids)
        usage = usage_of(len(prompt_ids), len(sample.token_ids))
        call_id = f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{episode_id}-{index}"
        if endpoint == "completion":
            return completion_answer(call_id, self.gcfg.model_name, text, sample.finish_reason, usage)
        tokenizer = self.engine.tokenizer
        raw = tokenizer.decode(sample.token_ids, skip_special_tokens=False) if request.tools is not None else None
        return chat_answer(call_id, self.gcfg.model_name, text, sample.finish_reason, usage, request.tools is not None,
                           self.tool_format, raw, list(getattr(tokenizer, "all_special_tokens", [])))

    def _check_open(self, episode_id: str) -> int:
        state = self.book.state(episode_id)
        if state not in ("new", "open"):
            raise RequestError(f"episode {episode_id!r} is {state.replace('_', '-')}: it takes no more calls",
                               status=409, code="episode_closed")
        index = self.book.next_index(episode_id)
        if index >= self.gcfg.max_calls_per_episode:
            raise RequestError(f"episode {episode_id!r} reached gateway.max_calls_per_episode="
                               f"{self.gcfg.max_calls_per_episode}", code="too_many_calls")
        return index

    def _prompt_ids(self, request: CallRequest) -> list[int]:
        if request.endpoint == "completion":
            ids = list(self.engine.tokenizer(request.prompt)["input_ids"])
        elif self.renderer is None:
            raise RequestError("chat calls need a chat template and data.chat_template is 'none': use "
                               "/v1/completions or set a template", param="messages")
        else:
            from stream_rl.prompts.render import RenderError

            try:
                _, ids = self.renderer.render(request.messages, request.tools)
            except RenderError as exc:
                raise RequestError(f"malformed messages: {exc}", param="messages") from None
        if len(ids) > self.gcfg.max_prompt_tokens:
            raise RequestError(f"too many tokens: the rendered prompt has {len(ids)} tokens, above "
                               f"gateway.max_prompt_tokens={self.gcfg.max_prompt_tokens}", code="too_many_tokens")
        return ids

    def _sampling(self, request: CallRequest) -> Sampling:
        sampling = self.sampling
        if request.temperature is not None:
            sampling = dataclasses.replace(sampling, temperature=request.temperature)
        if request.endpoint != "chat":
            return sampling
        try:
            found = self.chat.end_of_turn(request.messages)
        except Exception:  # noqa: BLE001 - a template that cannot render the probe: stop at eos only
            found = None
        return turn_sampling(sampling, None if found is None else found[1], self.engine.eos_token_id)

    # -- episode ends -----------------------------------------------------------------------------------------------

    def end(self, episode_id: str, body: Any) -> dict[str, Any]:
        """End ``episode_id``: with a reward, for the scorer to score, or as failed (dead-lettered)."""
        reward, answer, metadata, failed, refill = _read_end(body, episode_id)
        with self.lock:
            state = self.book.state(episode_id)
            if state == "new" and failed is not None:  # failed before its first call: its group counts it
                self._dead_letter_callless(episode_id, f"the agent ended the episode as failed before any call: "
                                                       f"{failed}", refill)
                self._publish_ready(group_of(episode_id))
                return self._answer(episode_id, 0)
            if state != "open":
                raise RequestError(f"episode {episode_id!r} is {'unknown' if state == 'new' else state}: only an "
                                   f"episode with calls can end", status=404 if state == "new" else 409,
                                   code="episode_not_open")
            calls = len(self.book.open[episode_id].calls)
            if failed is not None:
                self._dead_letter(episode_id, f"the agent ended the episode as failed: {failed}", "AgentFailed",
                                  refill)
            else:
                self._record(GatewayEpisode(episode_id=episode_id, outcome="ended", reward=reward, answer=answer,
                                            metadata=metadata, reason="", calls=calls))
            self._publish_ready(group_of(episode_id))
            return self._answer(episode_id, calls)

    def _answer(self, episode_id: str, calls: int | None) -> dict[str, Any]:
        """What the state and end endpoints answer: the episode's state and calls, and its group's ``members``
        (episodes counted toward ``group_size``) and ``refills_waiting`` (refilled ones whose replacement is owed)."""
        group = group_of(episode_id)
        return {"episode_id": episode_id, "state": self.book.state(episode_id), "calls": calls,
                "members": self.book.members(group), "refills_waiting": self.book.waiting_refills(group)}

    def sweep(self, now: float | None = None) -> list[str]:
        """Dead-letter every open episode idle past ``gateway.episode_timeout_s``, and count in its group every
        refilled episode whose replacement did not come within it; the episodes dead-lettered."""
        now = time.time() if now is None else now
        timeout = self.gcfg.episode_timeout_s
        with self.lock:
            idle = self.book.idle(now, timeout)
            for episode_id in idle:
                last = self.book.open[episode_id].last_seen
                self._dead_letter(episode_id, f"no call and no end for {now - last:.1f}s > gateway.episode_timeout_s"
                                              f"={timeout:g} (the agent crashed or hung)", "EpisodeTimeout")
                self._publish_ready(group_of(episode_id))
            for episode_id, calls in self.book.expired_refills(now, timeout):
                reason = (f"its replacement did not start within gateway.episode_timeout_s={timeout:g}: counted in "
                          f"its group as dead-lettered")
                log.warning("episode %s: %s", episode_id, reason)
                self._record(GatewayEpisode(episode_id=episode_id, outcome="dead_lettered", reason=reason,
                                            calls=calls))
                self._publish_ready(group_of(episode_id))
        return idle

    def _dead_letter(self, episode_id: str, reason: str, error_type: str, refill: bool = False) -> None:
        found = self.book.open[episode_id]
        reason = _refilled(reason, refill)
        self._send_letter(episode_id, encode(found.calls[min(found.calls)]), found.where, reason, error_type)
        self._record(GatewayEpisode(episode_id=episode_id, outcome="dead_lettered", reason=reason,
                                    calls=len(found.calls), refill=refill))

    def _dead_letter_callless(self, episode_id: str, reason: str, refill: bool = False) -> None:
        """Dead-letter an episode that made no call: the letter holds its ``dead_lettered`` record, written first."""
        record = GatewayEpisode(episode_id=episode_id, outcome="dead_lettered", reason=_refilled(reason, refill),
                                calls=0, refill=refill)
        self.sink.send(self.topics.gateway, record, key=episode_id)
        self._send_letter(episode_id, encode(record), _where(self.sink.flush()), record.reason, "AgentFailed")
        self.sink.flush()
        self.book.apply(record)

    def _send_letter(self, episode_id: str, value: bytes, where: tuple[str, int, int] | None, reason: str,
                     error_type: str) -> None:
        """A dead letter of ``episode_id`` holding ``value``, the record at ``where`` on the gateway topic."""
        topic, partition, offset = where or (self.topics.gateway, 0, 0)
        letter = DeadLetter.of_value(value, self.sink.max_request_size // 2, reason=reason, error_type=error_type,
                                     source_topic=topic, source_partition=partition, source_offset=offset,
                                     raw_key=episode_id.encode(), consumer_id=self.producer_id)
        self.sink.send(self.topics.dlq, letter, key=episode_id)
        log.warning("episode %s dead-lettered: %s", episode_id, reason)

    def state(self, episode_id: str) -> dict[str, Any]:
        """:meth:`_answer` for an episode (``new`` when the gateway never saw it; ``calls`` None unless open)."""
        with self.lock:
            found = self.book.open.get(episode_id)
            return self._answer(episode_id, len(found.calls) if found is not None else None)

    def _record(self, record: GatewayEpisode) -> None:
        self.sink.send(self.topics.gateway, record, key=record.episode_id)
        self.sink.flush()
        self.book.apply(record)

    def _publish_ready(self, group: str) -> None:
        episodes = self.book.ready(group)
        if episodes is None:
            return
        tokenizer = self.engine.tokenizer
        rollouts = assemble_group(group, episodes, self.producer_id,
                                  lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False))
        for rollout in rollouts:
            self.sink.send(self.topics.rollouts, rollout, key=rollout.group_id)
        self.sink.flush()
        log.info("group %s published: %d rollout(s) from %d episode(s)", group, len(rollouts), len(episodes))
        for episode in episodes:
            self._record(GatewayEpisode(episode_id=episode.episode_id, outcome="published", reason="",
                                        calls=len(episode.calls)))

    def metrics(self) -> dict[str, float]:
        """What the gateway's heartbeat reports: ``gateway/episodes_{open, ended, published, dead_lettered}`` (the
        book now: replayed episodes included) and ``gateway/calls``, ``gateway/tokens`` (answered and sampled since
        the process started)."""
        with self.lock:
            counts, calls, tokens = self.book.counts(), self.calls, self.tokens
        return {**{f"gateway/episodes_{state}": float(n) for state, n in counts.items()},
                "gateway/calls": float(calls), "gateway/tokens": float(tokens)}

    # -- restart ----------------------------------------------------------------------------------------------------

    def replay(self, records: Iterable) -> int:
        """Rebuild the book from the gateway topic's records (``stream_rl.transport.reader.Record``), then publish
        the groups complete but not yet published; the number of records read."""
        count = 0
        with self.lock:
            for record in records:
                if getattr(record, "value", None) is None:
                    continue
                try:
                    message = decode(record.value)
                except SchemaError as exc:  # not ours to rebuild from; the topic keeps it where it lies
                    log.warning("gateway record at %s[%d]@%d skipped: %s", record.topic, record.partition,
                                record.offset, exc)
                    continue
                if isinstance(message, GatewayCall):
                    self.book.add_call(message, (record.topic, record.partition, record.offset))
                elif isinstance(message, GatewayEpisode):
                    self.book.apply(message)
                count += 1
            for group in self.book.ready_groups():
                self._publish_ready(group)
        return count


class EndRequest(NamedTuple):
    """An episode end's body, checked: a reward (or None: the scorer scores it), a reference answer, tags, or a
    failure reason, and whether a replacement episode of its group takes the failed one's place."""

    reward: float | None
    answer: str | None
    metadata: dict[str, str]
    failed: str | None
    refill: bool


def _read_end(body: Any, episode_id: str) -> EndRequest:
    """The :class:`EndRequest` of an end request's body (:class:`RequestError` naming the bad field)."""
    body = {} if body is None else body
    if not isinstance(body, dict):
        raise RequestError("the body of an episode end must be a JSON object")
    reward, answer, metadata, failed = (body.get(k) for k in ("reward", "answer", "metadata", "failed"))
    refill = body.get("refill", False)
    if not isinstance(refill, bool):
        raise RequestError(f"refill must be true or false, got {refill!r:.40}", param="refill")
    if refill and failed is None:
        raise RequestError("refill needs failed: only an episode ended as failed is replaced", param="refill")
    if refill and group_of(episode_id) == episode_id:
        raise RequestError(f"refill needs an episode of a group (GROUP/NAME), got {episode_id!r}", param="refill")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                               or not np.isfinite(reward)):
        raise RequestError(f"reward must be a finite number or null, got {reward!r}", param="reward")
    if answer is not None and not isinstance(answer, str):
        raise RequestError("answer must be a string or null", param="answer")
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise RequestError("metadata must map strings to strings", param="metadata")
    if failed is not None and (not isinstance(failed, str) or not failed):
        raise RequestError("failed must be a non-empty reason", param="failed")
    return EndRequest(None if reward is None else float(reward), answer, dict(metadata), failed, refill)


def _refilled(reason: str, refill: bool) -> str:
    return f"{reason} (refilled: another episode of its group takes its place)" if refill else reason


def _where(acks) -> tuple[str, int, int] | None:
    """(topic, partition, offset) of the last record a flush acknowledged; None when it acknowledged none."""
    return (acks[-1].topic, acks[-1].partition, acks[-1].offset) if acks else None


def _seed(episode_id: str, index: int) -> int:
    digest = hashlib.sha256(f"{episode_id}|{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % SEED_MODULUS


def tool_format_of(setting: str, renderer, tokenizer) -> str:
    """``gateway.tool_format``, with ``auto`` resolved from the chat template the gateway renders with."""
    from producers.gateway.tool_formats import detect

    if setting != "auto":
        return setting
    template = getattr(renderer, "template", None) or getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the tool-use one renders calls with tools
        template = template.get("tool_use") or template.get("default")
    return detect(template if isinstance(template, str) else None)
