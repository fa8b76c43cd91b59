"""Multi-turn rollouts: the policy and an environment take turns until the environment ends the episode.

Consumes: accepted prompts with their token ids, a :class:`~producers.engines.base.GenerationEngine`, the sampling
settings, and a factory of :class:`~producers.environment.Environment` objects (one per rollout).
Produces: per prompt, ``n`` :class:`Episode` objects (a :class:`Sample` plus the policy mask, the per-turn tags
and the turns' texts), or the reason the prompt's environment failed.

One episode, for a token budget of ``max_new_tokens`` over all turns::

    prompt | policy turn 1 (mask 1) | env reply 1 (mask 0) | policy turn 2 (mask 1) | ... | policy turn k
             <------------------------- at most max_new_tokens tokens ------------------------->

Guarantees:
- Turn 1 samples the whole group from the prompt (one ``generate`` call for the prompts not already refused, as
  single-turn rollouts do); each later turn continues every live episode from its own context (prompt +
  everything so far), ``n = 1``, in one ``generate`` call per remaining budget. Seeds derive from ``seed`` and the
  turn: the same prompts, weights and environment give the same episodes.
- A conversational prompt on a chat template (``chat``) is checked before anything is generated
  (:meth:`~producers.chat_turns.ChatTurns.check`): a template that cannot continue it faithfully refuses the
  prompt with the reason, and later replies are checked again (:mod:`producers.chat_turns`).
- A policy turn ends at the template's own end-of-turn token (``<end_of_turn>``, ``<|end|>``, ``<|im_end|>``,
  learnt from the template, :meth:`~producers.chat_turns.ChatTurns.end_of_turn`), not only at eos: generation
  stops at it (it is added to the stop token ids unless ``producer.stop_token_ids`` is set, which then wins as
  given), and a turn that sampled it does not get it appended again.
- Policy tokens carry their engine's behaviour logprobs and the version that produced them; environment tokens
  carry logprob 0, the engine's version when they were appended, and mask 0 (no loss).
- An episode ends when the environment says ``done`` (or a tool replies ``None`` or nothing), after ``max_turns``
  policy turns (``finish_reason`` of the last turn), or when the budget runs out: a policy turn cut at the budget,
  or a reply that leaves no room for another policy token, ends it with ``"length"`` (the reply is not appended).
- The result always ends with a policy turn, and ``turns`` has one tag map per run of the mask
  (``Rollout.turns``' rule in docs/wire-format.md).
- An environment that raises, returns something that is not an answer, or (with a deadline,
  :class:`~producers.environment.EnvironmentFactory`) does not answer within ``producer.env_timeout_s`` fails its
  group only, never trains it partially: the group is played again from the prompt with fresh environments and a
  seed of its own (:func:`refill_seed`), up to the factory's ``refills`` times; a group that still fails comes back
  with the reason of its last failure (the producer dead-letters the prompt with it) and the other prompts'
  episodes go on; a failure whose group is played again is logged (WARNING) with the prompt id and kept in the
  factory's ``replayed`` for the producer to dead-letter (``EnvironmentFailed``: that play's episodes are dropped).
  Each group's outcome is counted in the factory's :class:`~producers.environment.EnvironmentHealth` (one per
  episode: ok, failed, timed_out; refilled per replay).
- An environment's step rewards (:attr:`~producers.environment.Observation.reward`, e.g. an OpenEnv rubric's) are
  summed per episode (:attr:`Episode.env_reward`) and reach the rollout's metadata as ``episode_reward``.
- An environment's reply is bounded before it is tokenised: one longer than ``max_new_tokens *``
  :data:`MAX_REPLY_CHARS_PER_TOKEN` characters cannot fit the budget and ends the episode with ``"length"``; at
  most :data:`MAX_TAGS` tags of :data:`MAX_TAG_CHARS` characters (keys and values, cut beyond) reach the rollout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from producers.chat_turns import ChatTurns, TemplateDriftError
from producers.engines.base import SEED_MODULUS, GenerationEngine, Sample, Sampling
from producers.environment import Environment, EnvironmentFactory, EnvironmentTimeout, Guarded, Observation
from schemas import Prompt
from stream_rl.rewards.given import REWARD_KEY

log = logging.getLogger(__name__)

TURN_SEPARATOR = "\n"
"""Joins the turns' texts into ``Rollout.response_text``."""
MAX_REPLY_CHARS_PER_TOKEN = 64
"""A reply longer than this many characters per token of budget cannot fit: it is not tokenised."""
MAX_TAGS, MAX_TAG_CHARS = 16, 256
TIMED_OUT = "environment timed out"


@dataclass(frozen=True)
class Episode(Sample):
    """A multi-turn sample: ``policy_mask`` [R] (1 = sampled by the policy), one tag map per turn, the turns'
    decoded texts."""

    policy_mask: list[int] = field(default_factory=list)
    turns: list[dict[str, str]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    env_reward: float | None = None  # the sum of the environment's step rewards (None: it gave none)

    @property
    def response_text(self) -> str:
        return TURN_SEPARATOR.join(self.texts)

    @property
    def env_metadata(self) -> dict[str, str]:
        """What the episode adds to its rollout's metadata: the environment's reward under
        ``stream_rl.rewards.given.REWARD_KEY`` when it gave one."""
        return {} if self.env_reward is None else {REWARD_KEY: repr(self.env_reward)}


@dataclass
class _Live:
    """An episode being played."""

    prompt_ids: list[int]
    env: Environment
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[dict[str, str]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish: str = "stop"
    done: bool = False
    messages: list[dict[str, str]] | None = None  # the conversation so far (conversational prompts on a template)
    reward: float | None = None  # the environment's step rewards so far
    ended_turn: bool = False  # the last policy turn ended with the template's end-of-turn token

    def episode(self) -> Episode:
        return Episode(token_ids=self.tokens, logprobs=self.logprobs, finish_reason=self.finish,
                       token_versions=self.versions, policy_mask=self.mask, turns=self.turns, texts=self.texts,
                       env_reward=self.reward)


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn ``turn`` (0-based) of a batch whose seed is ``seed``."""
    if turn == 0:
        return seed
    digest = hashlib.sha256(f"{seed}|turn {turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % SEED_MODULUS


def run_episodes(engine: GenerationEngine, prompts: Sequence[Prompt], prompt_ids: Sequence[list[int]], n: int, *,
                 sampling: Sampling, max_new_tokens: int, seed: int, make_env: Callable[[], Environment],
                 max_turns: int, chat: ChatTurns | None = None) -> list[list[Episode] | str]:
    """Play ``n`` episodes per prompt (see the module guarantees); per prompt its episodes or a failure reason.

    ``chat``: for a conversational prompt (``Prompt.messages``), replies are chat messages rendered by the template
    (:mod:`producers.chat_turns`); plain text prompts get the reply's text tokens as they are. ``make_env``: an
    :class:`~producers.environment.EnvironmentFactory` refills failed groups and counts outcomes; a plain callable
    does neither."""
    play = lambda indices, play_seed: _play(  # noqa: E731
        engine, [prompts[i] for i in indices], [prompt_ids[i] for i in indices], n, sampling=sampling,
        max_new_tokens=max_new_tokens, seed=play_seed, make_env=make_env, max_turns=max_turns, chat=chat)
    results = play(range(len(prompts)), seed)
    factory = make_env if isinstance(make_env, EnvironmentFactory) else None
    for attempt in range(1, 1 + (factory.refills if factory is not None else 0)):
        again = [i for i, result in enumerate(results) if isinstance(result, str) and _refillable(result)]
        if not again:
            break
        _count(factory, [results[i] for i in again], n, refilled=True)
        for i in again:  # each failed play is dead-lettered by the producer (factory.replayed), then played again
            reason = f"{results[i]}; its group is played again (refill {attempt} of {factory.refills})"
            log.warning("prompt %s: %s", prompts[i].prompt_id, reason)
            factory.replayed.append((prompts[i].prompt_id, prompts[i].epoch, reason))
        for index, result in zip(again, play(again, refill_seed(seed, attempt)), strict=True):
            results[index] = result
    _count(factory, results, n)
    return results


def refill_seed(seed: int, attempt: int) -> int:
    """The sampling seed of refill ``attempt`` (1-based) of the failed groups of a batch whose seed is ``seed``."""
    digest = hashlib.sha256(f"{seed}|refill {attempt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % SEED_MODULUS


def _refillable(reason: str) -> bool:
    """An environment's failure (not a chat template's refusal, which another try cannot change)."""
    return reason.startswith(("environment failed", TIMED_OUT))


def _count(factory: EnvironmentFactory | None, results: Sequence[list[Episode] | str], n: int,
           refilled: bool = False) -> None:
    """Add ``results``' outcomes to the factory's health: ``n`` episodes per group (a failed group's episodes all
    count as failed or timed out); ``refilled``: the failed groups about to be played again."""
    if factory is None:
        return
    health = factory.health
    for result in results:
        if not isinstance(result, str):
            health.ok += 0 if refilled else n
        elif _refillable(result):
            health.refilled += refilled
            if result.startswith(TIMED_OUT):
                health.timed_out += n
            else:
                health.failed += n


def _play(engine: GenerationEngine, prompts: Sequence[Prompt], prompt_ids: Sequence[list[int]], n: int, *,
          sampling: Sampling, max_new_tokens: int, seed: int, make_env: Callable[[], Environment],
          max_turns: int, chat: ChatTurns | None = None) -> list[list[Episode] | str]:
    """One play of every prompt's group (:func:`run_episodes` without refills)."""
    lives, failed = _start(prompts, prompt_ids, n, make_env, chat)
    try:
        return _turns(engine, prompts, prompt_ids, n, lives, failed, sampling=sampling,
                      max_new_tokens=max_new_tokens, seed=seed, max_turns=max_turns, chat=chat)
    finally:  # the play is over, played to the end or failed: isolated environments' processes end here
        for group in lives:
            for live in group:
                if isinstance(live.env, Guarded):
                    live.env.close()


def _turns(engine: GenerationEngine, prompts: Sequence[Prompt], prompt_ids: Sequence[list[int]], n: int,
           lives: list[list[_Live]], failed: dict[int, str], *, sampling: Sampling, max_new_tokens: int, seed: int,
           max_turns: int, chat: ChatTurns | None) -> list[list[Episode] | str]:
    """The turns of one play after :func:`_start`: the first policy turn, then environment and policy turns."""
    eot = _end_of_turn(chat, prompts, failed)
    end_id = eot if eot is not None else getattr(engine.tokenizer, "eos_token_id", None)
    sampling = turn_sampling(sampling, eot, engine.eos_token_id)
    ready = [index for index in range(len(prompts)) if index not in failed]
    version = engine.version
    first = engine.generate([list(prompt_ids[i]) for i in ready], n, sampling, max_new_tokens, seed) if ready else []
    for index, samples in zip(ready, first, strict=True):
        for live, sample in zip(lives[index], samples, strict=True):
            _policy_turn(live, sample, version, engine, max_new_tokens, end_id)
    for turn in range(1, max_turns):
        for index, group in enumerate(lives):
            if index not in failed:
                failed.update(_guard(index, lambda: [_env_turn(live, engine, max_new_tokens, chat)
                                                     for live in group if not live.done]))
        active = [live for index, group in enumerate(lives) if index not in failed for live in group
                  if not live.done]
        if not active:
            break
        _continue(active, engine, sampling, max_new_tokens, turn_seed(seed, turn), end_id)
    return [failed[i] if i in failed else [live.episode() for live in group] for i, group in enumerate(lives)]


def turn_sampling(sampling: Sampling, end_of_turn: int | None, eos: int) -> Sampling:
    """The sampling of an episode's policy turns: ``sampling`` with the template's end-of-turn token as its stop
    token id, unless ``producer.stop_token_ids`` is set (then it is used as given: list the end-of-turn token in it
    to keep stopping there) or that token is the eos token (always a stop)."""
    if sampling.stop_token_ids or end_of_turn is None or end_of_turn == eos:
        return sampling
    return dataclasses.replace(sampling, stop_token_ids=(end_of_turn,))


def _start(prompts: Sequence[Prompt], prompt_ids: Sequence[list[int]], n: int, make_env: Callable[[], Environment],
           chat: ChatTurns | None) -> tuple[list[list[_Live]], dict[int, str]]:
    """One live episode per sample, its environment reset, and the prompts refused before generating (an
    environment whose reset raised, a conversation the chat template cannot continue): ``{index: reason}``."""
    failed: dict[int, str] = {}
    lives: list[list[_Live]] = []
    for index, prompt in enumerate(prompts):
        messages = [dict(m) for m in prompt.messages] if chat is not None and prompt.messages else None
        if messages is not None:
            failed.update(_guard(index, lambda: chat.check(messages, prompt_ids[index])))
        group = []
        for _ in range(n):
            env = make_env()
            if index not in failed:
                failed.update(_guard(index, lambda: env.reset(prompt)))
            group.append(_Live(list(prompt_ids[index]), env, messages=None if messages is None else list(messages)))
        lives.append(group)
    return lives, failed


def _end_of_turn(chat: ChatTurns | None, prompts: Sequence[Prompt], failed: dict[int, str]) -> int | None:
    """The id of the chat template's end-of-turn token, learnt on the first conversational prompt not refused
    (None: no chat, no such prompt, or a closing that does not start with a special token)."""
    index = next((i for i, p in enumerate(prompts) if p.messages and i not in failed), None)
    if chat is None or index is None:
        return None
    found = chat.end_of_turn([dict(m) for m in prompts[index].messages])
    return None if found is None else found[1]


def as_observation(value: object) -> Observation:
    """An environment's answer as an :class:`Observation`: one as is, a reply string, or None (the end)."""
    if isinstance(value, Observation):
        return value
    if value is None:
        return Observation("", done=True)
    if isinstance(value, str):
        return Observation(value, done=not value)
    raise TypeError(f"environment step returned {type(value).__name__}; expected an Observation, a str or None")


def _guard(index: int, call: Callable[[], object]) -> dict[int, str]:
    """Run an environment call; ``{index: reason}`` when it raised (the prompt fails, nothing else does)."""
    try:
        call()
    except TemplateDriftError as exc:  # the chat template cannot continue this conversation without drift
        return {index: f"chat template: {exc}"}
    except EnvironmentTimeout as exc:
        return {index: f"{TIMED_OUT}: {exc}"}
    except Exception as exc:  # a user environment: any failure is that prompt's, reported with its reason
        return {index: f"environment failed: {type(exc).__name__}: {exc}"}
    return {}


def _policy_turn(live: _Live, sample: Sample, version: int, engine: GenerationEngine, max_new_tokens: int,
                 end_id: int | None) -> None:
    """Append one policy turn (``end_id``: the end-of-turn token's id); a turn cut at the remaining budget ends the
    episode with ``"length"``."""
    live.tokens += sample.token_ids
    live.logprobs += sample.logprobs
    live.versions += sample.token_versions or [version] * len(sample.token_ids)
    live.mask += [1] * len(sample.token_ids)
    live.turns.append({"role": "policy", "finish_reason": sample.finish_reason})
    live.texts.append(engine.tokenizer.decode(sample.token_ids, skip_special_tokens=True))
    live.ended_turn = bool(sample.token_ids) and end_id is not None and sample.token_ids[-1] == end_id
    live.finish = sample.finish_reason
    if sample.finish_reason == "length" or len(live.tokens) >= max_new_tokens:
        live.done, live.finish = True, "length"


def _env_turn(live: _Live, engine: GenerationEngine, max_new_tokens: int, chat: ChatTurns | None = None) -> None:
    """Ask the environment about the last policy turn; append its reply or end the episode."""
    obs = as_observation(live.env.step(live.texts[-1]))
    if obs.reward is not None:  # counted when it ends the episode too (the last step often carries it)
        live.reward = (live.reward or 0.0) + float(obs.reward)
    if obs.done or not obs.text:
        live.done = True
        return
    if len(obs.text) > max_new_tokens * MAX_REPLY_CHARS_PER_TOKEN:  # cannot fit: not tokenised
        live.done, live.finish = True, "length"
        return
    reply = _reply_tokens(live, obs, engine, chat)
    if not reply:
        live.done = True
        return
    if len(live.tokens) + len(reply) >= max_new_tokens:  # no room for another policy token after the reply
        live.done, live.finish = True, "length"
        return
    live.tokens += reply
    live.logprobs += [0.0] * len(reply)
    live.versions += [engine.version] * len(reply)
    live.mask += [0] * len(reply)
    live.turns.append({**_bounded_tags(obs.tags), "role": "env"})
    live.texts.append(obs.text)
    if live.messages is not None:
        live.messages += [{"role": "assistant", "content": live.texts[-2]}, {"role": obs.role, "content": obs.text}]


def _bounded_tags(tags: dict[str, str]) -> dict[str, str]:
    """At most MAX_TAGS string tags, keys and values cut at MAX_TAG_CHARS characters."""
    if not isinstance(tags, dict):
        raise TypeError(f"Observation.tags must be a dict of strings, got {type(tags).__name__}")
    return {str(k)[:MAX_TAG_CHARS]: str(v)[:MAX_TAG_CHARS] for k, v in list(tags.items())[:MAX_TAGS]}


def _reply_tokens(live: _Live, obs: Observation, engine: GenerationEngine, chat: ChatTurns | None) -> list[int]:
    """The reply's ids: as a chat message on the template (conversational prompts), else its text's tokens."""
    if live.messages is None or chat is None:
        return list(engine.tokenizer(obs.text, add_special_tokens=False)["input_ids"])
    return chat.reply_tokens(live.messages, live.texts[-1], live.ended_turn,
                             {"role": obs.role, "content": obs.text})


def _continue(active: list[_Live], engine: GenerationEngine, sampling: Sampling, max_new_tokens: int,
              seed: int, end_id: int | None) -> None:
    """One more policy turn for every live episode: one ``generate`` call per remaining budget."""
    by_budget: dict[int, list[_Live]] = {}
    for live in active:
        by_budget.setdefault(max_new_tokens - len(live.tokens), []).append(live)
    for budget, lives in sorted(by_budget.items()):
        version = engine.version
        samples = engine.generate([live.prompt_ids + live.tokens for live in lives], 1, sampling, budget, seed)
        for live, (sample,) in zip(lives, samples, strict=True):
            _policy_turn(live, sample, version, engine, max_new_tokens, end_id)
