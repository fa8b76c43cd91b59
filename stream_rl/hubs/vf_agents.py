"""verifiers environments played by verifiers' own agent loop against an OpenAI endpoint (the gateway).

Consumes: a spec ``verifiers:TASKSET_ID?size=N`` (as :mod:`stream_rl.hubs.vf` reads it), verifiers' agent
settings (a mapping of ``verifiers.v1.AgentConfig`` fields: ``harness``, ``runtime``, ``max_turns``, ...), and per
episode an endpoint's base URL, the model name it serves and the episode id.
Produces: :func:`load_env` -> :class:`AgentEnv` (verifiers' ``Env`` of the taskset, its first ``size`` tasks, and
the ``serving()`` context its episodes run in); :meth:`AgentEnv.play` -> :class:`Outcome`: the reward verifiers'
own rubric gave the episode (the weighted sum of the task's ``@vf.reward`` functions and judges over the whole
multi-turn trace), or the reason the episode failed.

Guarantees:
- Every model call of an episode carries the episode id in the ``X-Episode-Id`` header (verifiers' interception
  relays the agent program's calls with it), so the gateway records them under that episode and nothing else.
- :meth:`AgentEnv.play` never raises for what the environment does: an episode that errs (its harness failed to
  start, a tool or reward raised, a deadline of verifiers' passed), has no trainable trace or several, has a
  reward verifiers left unscored or a non-finite one, or outlasts ``timeout_s``, is an :class:`Outcome` with the
  reason (at most :data:`REASON_CHARS` characters), never a reward.
- Loading is a boundary: anything the taskset's code raises while the environment is built or its tasks listed
  is a :class:`SpecError` naming the taskset and the error.
- Only single-agent environments are played (one trainable trace per episode is one rollout chain); one that
  declares several agents is refused at :func:`load_env`, naming them.
- ``verifiers`` is imported only here, when a driver names an environment; without it, :class:`HubMissing`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stream_rl.hubs import HubMissing
from stream_rl.hubs.vf import SpecError, parse_spec

REASON_CHARS = 500
KEY_VAR = "STREAM_RL_GATEWAY_API_KEY"
"""The environment variable verifiers reads the endpoint's API key from (unset: verifiers sends ``EMPTY``; the
gateway reads the episode id from the header)."""


@dataclass(frozen=True)
class Outcome:
    """One played episode: its ``reward``, or the ``reason`` it failed (exactly one is set); ``timed_out``: it
    failed on a deadline (the driver's or one of verifiers')."""

    reward: float | None
    reason: str | None = None
    timed_out: bool = False


@dataclass
class AgentEnv:
    """A loaded verifiers environment (:func:`load_env`)."""

    taskset: str
    size: int
    env: Any  # verifiers.v1.Env
    tasks: list

    def serving(self):
        """verifiers' serving resources (interception, shared tool servers): every :meth:`play` runs inside."""
        return self.env.serving()

    async def play(self, task, base_url: str, model: str, episode_id: str, timeout_s: float) -> Outcome:
        """Play one episode of ``task`` with the model at ``base_url`` (module guarantees)."""
        from verifiers.v1.clients import EvalClientConfig, ModelContext

        client = EvalClientConfig(base_url=base_url, api_key_var=KEY_VAR, headers={"X-Episode-Id": episode_id})
        try:
            async with asyncio.timeout(timeout_s):
                episode = await self.env.run_episode(task, ModelContext(model=model, client=client))
        except TimeoutError:
            return Outcome(None, f"the episode outlasted {timeout_s:g}s (driver.episode_timeout_s)", True)
        except Exception as exc:  # an environment's own failure is this episode's, never the driver's
            return Outcome(None, _clip(f"{type(exc).__name__}: {exc}"))
        return outcome_of(episode)


def outcome_of(episode) -> Outcome:
    """The :class:`Outcome` of a finished verifiers ``Episode`` (module guarantees)."""
    if not episode.ok:
        errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
        first = errors[0] if errors else None
        why = f"{first.type}: {first.message}" if first is not None else "verifiers marked the episode not ok"
        timed_out = episode.is_timeout or any(t.is_timeout for t in episode.traces)
        return Outcome(None, _clip(f"the episode failed: {why}"), timed_out)
    trainable = [t for t in episode.traces if t.agent.trainable]
    if len(trainable) != 1:
        return Outcome(None, f"the episode has {len(trainable)} trainable traces; one is trained per episode")
    trace = trainable[0]
    unscored = sorted(name for name, value in trace.rewards.items() if value is None)
    if not trace.rewards or unscored:
        return Outcome(None, _clip("verifiers scored no reward" + (f" ({', '.join(unscored)} unscored)"
                                                                  if unscored else " (the task has none)")))
    reward = float(trace.reward)
    if not math.isfinite(reward):
        return Outcome(None, f"verifiers scored a non-finite reward ({reward})")
    return Outcome(reward)


def load_env(spec: str, agent: Mapping[str, Any]) -> AgentEnv:
    """verifiers' environment of the spec's taskset, its agent configured by ``agent``; SpecError naming what is
    wrong (an unknown taskset, a bad agent setting, several agents)."""
    taskset, size = parse_spec(spec)
    try:
        from verifiers.v1.configs.agent import agent_config_fields
        from verifiers.v1.utils.loaders import env_config_type, load_environment, resolve_env_config
    except ImportError:
        raise HubMissing("verifiers", "a verifiers agent environment (driver.environment)") from None
    # the taskset's own code runs in both steps: any failure of it is a refusal naming it, not a traceback
    try:
        seats = sorted(agent_config_fields(env_config_type(taskset)(taskset={"id": taskset})))
    except Exception as exc:
        raise _cannot_load(taskset, agent, exc) from None
    if seats != ["agent"]:
        raise SpecError(f"verifiers environment of taskset {taskset!r} declares agents {', '.join(seats)}: the "
                        f"driver plays single-agent environments (one trainable agent per episode)")
    try:
        env = load_environment(resolve_env_config({"taskset": {"id": taskset}, "agent": dict(agent)}))
    except Exception as exc:
        raise _cannot_load(taskset, agent, exc) from None
    tasks: list = []
    try:
        for task in env.taskset:
            if len(tasks) == size:
                break
            tasks.append(task)
    except Exception as exc:
        raise SpecError(f"verifiers taskset {taskset!r} failed while listing its tasks (after {len(tasks)}): "
                        f"{type(exc).__name__}: {_clip(str(exc), 400)}") from None
    if not tasks:
        raise SpecError(f"verifiers taskset {taskset!r} has no task")
    return AgentEnv(taskset, size, env, tasks)


def _cannot_load(taskset: str, agent: Mapping[str, Any], exc: Exception) -> SpecError:
    return SpecError(f"verifiers cannot load an environment of taskset {taskset!r} with agent {dict(agent)!r}: "
                     f"{type(exc).__name__}: {_clip(str(exc), 400)}")


def _clip(text: str, limit: int = REASON_CHARS) -> str:
    """``text`` on one line (a reason is one line of a log or a dead letter), at most ``limit`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
