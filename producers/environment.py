"""The environment interface of multi-turn rollouts, and loading one from a ``module:name`` reference.

Consumes: ``producer.environment``, a ``"package.module:Name"`` reference to either
- a class whose instances have ``reset(prompt)`` and ``step(policy_text) -> Observation`` (one instance per
  rollout, so state never leaks between the samples of a group), or
- a tool function ``fn(policy_text) -> str | None``: its reply is the next observation, ``None`` ends the episode,
or a hub's environment by name: ``"openenv:package.module:EnvClass"`` (an OpenEnv environment class,
:mod:`producers.hub_envs`), or ``"openenv+http://HOST:PORT"`` (a running OpenEnv server, one session per rollout,
:mod:`producers.openenv_remote`).

Produces: an :class:`EnvironmentFactory` (:func:`load_environment`) that makes one fresh :class:`Guarded`
environment per rollout, calls it under ``producer.env_timeout_s`` and counts its episodes in
:class:`EnvironmentHealth`; ``producer.env_refills`` failed groups are played again (:mod:`producers.multiturn`).
Guarantees:
- A bad reference (no ``:``, a module that does not import, a missing name, an object that is neither a class with
  ``reset``/``step`` nor a callable of one argument) raises :class:`EnvironmentLoadError` naming the reference and
  what is wrong, at start-up, before any prompt is read.
- An environment is an adversary (docs/agents.md, "Environment hubs"): it is made at its first ``reset`` (a
  constructor's failure is that episode's); under a deadline, each ``reset`` (construction included) and ``step``
  runs in a thread of its own and a call past ``deadline_s`` raises :class:`EnvironmentTimeout` naming the call
  and the deadline; the call's thread is abandoned (a daemon: it ends on its own or with the process) and the
  producer goes on. A call that never gives back the GIL (a C extension spinning) or kills the process is beyond
  what a thread can contain: ``producer.env_isolation = "process"`` runs each instance in a child process
  (:mod:`producers.env_process`), killed at the deadline, whose death fails only its episode.
"""

from __future__ import annotations

import inspect
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from schemas import Prompt
from stream_rl.runtime import references


REMOTE_PREFIX = "openenv+"  # producer.environment = "openenv+http://HOST:PORT" (producers.openenv_remote)


class EnvironmentLoadError(ValueError):
    """``producer.environment`` does not name a usable environment or tool."""


class EnvironmentTimeout(TimeoutError):
    """An environment's ``reset`` or ``step`` did not return within its deadline; ``str()`` is the reason."""


@dataclass(frozen=True)
class Observation:
    """What the environment answers to one policy turn.

    ``text`` is appended to the rollout as environment tokens (tokenised without special tokens; they are attended
    by the next turn but get no loss); ``done`` ends the episode (``text`` is then not appended); ``tags`` are
    string metadata of this environment turn, written into ``Rollout.turns`` beside ``role = "env"``; ``role`` is the
    chat role the reply takes in a conversational prompt's conversation (``user``, or ``tool`` for a tool's
    result), rendered by the chat template (:mod:`producers.chat_turns`); ``reward``: the environment's own reward
    for this step (its rubric's), summed over the episode into the rollout's ``metadata["episode_reward"]``, which
    ``stream_rl.rewards.given:episode_reward`` passes through the scorer (None: the environment gives none)."""

    text: str
    done: bool = False
    tags: dict[str, str] = field(default_factory=dict)
    role: str = "user"
    reward: float | None = None

    def __post_init__(self) -> None:
        if self.role not in ("user", "tool"):
            raise ValueError(f"Observation.role must be 'user' or 'tool', got {self.role!r}")
        if self.reward is not None and not (isinstance(self.reward, int | float) and math.isfinite(self.reward)):
            raise ValueError(f"Observation.reward must be a finite number or None, got {self.reward!r}")


class Environment(Protocol):
    """One episode's environment: ``reset`` once with the prompt, then ``step`` after every policy turn.

    ``step`` returns an :class:`Observation`, or simply the reply text (``""`` or ``None``: the episode ends), so
    an environment needs nothing from this package."""

    def reset(self, prompt: Prompt) -> None: ...

    def step(self, policy_text: str) -> Observation | str | None: ...


class ToolEnvironment:
    """A tool function as an environment: its reply is the observation, ``None`` (or an empty reply) ends."""

    def __init__(self, tool: Callable[[str], str | None], name: str) -> None:
        self.tool, self.name = tool, name

    def reset(self, prompt: Prompt) -> None:
        """Tools keep no episode state."""

    def step(self, policy_text: str) -> Observation:
        reply = self.tool(policy_text)
        if reply is not None and not isinstance(reply, str):
            raise TypeError(f"tool {self.name} returned {type(reply).__name__}, expected str or None")
        return Observation(reply or "", done=not reply, tags={"tool": self.name}, role="tool")


@dataclass
class EnvironmentHealth:
    """Episodes of one environment by outcome: played to the end (``ok``), failed (the environment raised or
    returned something unusable) or timed out (past its deadline); ``refilled``: groups played again after one."""

    ok: int = 0
    failed: int = 0
    timed_out: int = 0
    refilled: int = 0

    def metrics(self, name: str) -> dict[str, float]:
        """``env/{name}/{ok,failed,timed_out,refilled}``: counts since the producer started."""
        return {f"env/{name}/{key}": float(value) for key, value in vars(self).items()}


class Guarded:
    """An environment made at its first ``reset`` (a constructor that raises or hangs is that episode's failure),
    whose ``reset`` and ``step`` each run under ``deadline_s`` (None: called directly; the module guarantees)."""

    def __init__(self, make: Callable[[], Environment], deadline_s: float | None, name: str) -> None:
        self.make, self.deadline_s, self.name = make, deadline_s, name
        self.env: Environment | None = None

    def reset(self, prompt: Prompt) -> None:
        self._call(lambda: self._made().reset(prompt), "reset")

    def step(self, policy_text: str) -> Observation | str | None:
        return self._call(lambda: self._made().step(policy_text), "step")

    def _made(self) -> Environment:
        if self.env is None:
            self.env = self.make()
        return self.env

    def close(self) -> None:
        """The episode is over: end an isolated environment's process (``producer.env_isolation = "process"``) or
        a served environment's session (:mod:`producers.openenv_remote`); an in-process environment is left to the
        garbage collector, as before."""
        from producers.env_process import ProcessEnvironment
        from producers.openenv_remote import RemoteOpenEnvEpisode

        if isinstance(self.env, (ProcessEnvironment, RemoteOpenEnvEpisode)):
            self.env.close()

    def _call(self, call: Callable[[], Any], what: str) -> Any:
        if self.deadline_s is None:
            return call()
        return call_with_deadline(call, self.deadline_s, f"{self.name} {what}")


def call_with_deadline(call: Callable[[], Any], deadline_s: float, what: str) -> Any:
    """``call()``'s value or exception, from a daemon thread; :class:`EnvironmentTimeout` past ``deadline_s``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the caller's thread as is
            box["error"] = exc

    worker = threading.Thread(target=run, name=f"env {what}", daemon=True)
    worker.start()
    worker.join(deadline_s)
    if worker.is_alive():
        raise EnvironmentTimeout(f"environment {what} timed out after {deadline_s:g} s (producer.env_timeout_s)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


@dataclass
class EnvironmentFactory:
    """Fresh environments of one reference, each :class:`Guarded` by ``deadline_s`` (None: called directly);
    ``refills``: how many times :func:`producers.multiturn.run_episodes` plays a failed group again;
    ``health``: its episodes' outcomes."""

    make: Callable[[], Environment]
    name: str
    deadline_s: float | None = None
    refills: int = 0
    health: EnvironmentHealth = field(default_factory=EnvironmentHealth)
    replayed: list[tuple[str, int, str]] = field(default_factory=list)
    """(prompt_id, epoch, reason) of each failed play whose group was played again, until :meth:`drain_replayed`
    (the producer dead-letters each: an auditable drop of that attempt's episodes)."""

    def __call__(self) -> Guarded:
        return Guarded(self.make, self.deadline_s, self.name)

    def drain_replayed(self) -> list[tuple[str, int, str]]:
        out, self.replayed = self.replayed, []
        return out

    def health_metrics(self) -> dict[str, float]:
        """``env/{name}/{ok,failed,timed_out,refilled}`` (:meth:`EnvironmentHealth.metrics`)."""
        return self.health.metrics(self.name)


def load_environment(reference: str, deadline_s: float | None = None, refills: int = 0,
                     isolation: str = "thread") -> EnvironmentFactory:
    """A factory of fresh environments for ``reference`` (see the module docstring), each call of theirs under
    ``deadline_s`` (None: none); a failed group is played again up to ``refills`` times. ``isolation``:
    ``"thread"``, each instance in this process; ``"process"``, each instance in a child process of its own
    (:mod:`producers.env_process`: an environment that exits, crashes or hangs without giving back the GIL fails
    only its episode). The reference is checked here, in this process, either way."""
    if reference.startswith(REMOTE_PREFIX):  # a served OpenEnv environment: its code runs in its server
        if isolation != "thread":
            raise EnvironmentLoadError(f"producer.env_isolation = {isolation!r} with a served environment "
                                       f"(producer.environment '{REMOTE_PREFIX}...'): its code already runs in its "
                                       f"server; use 'thread'")
        from producers.openenv_remote import remote_factory

        served, name = remote_factory(reference.removeprefix(REMOTE_PREFIX), deadline_s)
        return EnvironmentFactory(served, name, deadline_s, refills)
    make, name = _factory(reference), reference.rsplit(":", 1)[-1]
    if isolation == "process":
        from producers.env_process import ProcessEnvironment

        return EnvironmentFactory(lambda: ProcessEnvironment(reference, deadline_s, name), name, None, refills)
    if isolation != "thread":
        raise EnvironmentLoadError(f"producer.env_isolation must be 'thread' or 'process', got {isolation!r}")
    return EnvironmentFactory(make, name, deadline_s, refills)


def _factory(reference: str) -> Callable[[], Environment]:
    if reference.startswith("openenv:"):  # a hub's environment by name (producers.hub_envs)
        from producers.hub_envs import openenv_factory

        return openenv_factory(reference.removeprefix("openenv:"))
    obj = _resolve(reference)
    if inspect.isclass(obj):
        missing = [name for name in ("reset", "step") if not callable(getattr(obj, name, None))]
        if missing:
            raise EnvironmentLoadError(f"producer.environment {reference!r}: class {obj.__name__} has no "
                                       f"{' or '.join(missing)} method (an environment needs reset(prompt) and "
                                       f"step(policy_text) -> Observation)")
        return obj
    if not callable(obj):
        raise EnvironmentLoadError(f"producer.environment {reference!r} is a {type(obj).__name__}, neither an "
                                   f"environment class nor a tool function")
    try:
        inspect.signature(obj).bind("text")
    except TypeError as exc:
        raise EnvironmentLoadError(f"producer.environment {reference!r}: a tool function is called as "
                                   f"fn(policy_text): {exc}") from None
    except ValueError:  # no introspectable signature (some builtins): trust it
        pass
    name = reference.split(":", 1)[1]
    return lambda: ToolEnvironment(obj, name)


def _resolve(reference: str) -> Any:
    return references.resolve_reference(reference, what="producer.environment", error=EnvironmentLoadError,
                                        attr_label="Name")