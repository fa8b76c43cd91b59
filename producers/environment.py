"""The environment interface of multi-turn rollouts, and loading one from a ``module:name`` reference.

Consumes: ``producer.environment``, a ``"package.module:Name"`` reference to either
- a class whose instances have ``reset(prompt)`` and ``step(policy_text) -> Observation`` (one instance per
  rollout, so state never leaks between the samples of a group), or
- a tool function ``fn(policy_text) -> str | None``: its reply is the next observation, ``None`` ends the episode.

Produces: a factory that makes one fresh :class:`Environment` per rollout (:func:`load_environment`).
Guarantees: a bad reference (no ``:``, a module that does not import, a missing name, an object that is neither a
class with ``reset``/``step`` nor a callable of one argument) raises :class:`EnvironmentLoadError` naming the
reference and what is wrong, at start-up, before any prompt is read.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from schemas import Prompt
from stream_rl.runtime import references


class EnvironmentLoadError(ValueError):
    """``producer.environment`` does not name a usable environment or tool."""


@dataclass(frozen=True)
class Observation:
    """What the environment answers to one policy turn.

    ``text`` is appended to the rollout as environment tokens (tokenised without special tokens; they are attended
    by the next turn but get no loss); ``done`` ends the episode (``text`` is then not appended); ``tags`` are
    string metadata of this environment turn, written into ``Rollout.turns`` beside ``role = "env"``; ``role`` is the
    chat role the reply takes in a conversational prompt's conversation (``user``, or ``tool`` for a tool's
    result), rendered by the chat template (:mod:`producers.chat_turns`)."""

    text: str
    done: bool = False
    tags: dict[str, str] = field(default_factory=dict)
    role: str = "user"

    def __post_init__(self) -> None:
        if self.role not in ("user", "tool"):
            raise ValueError(f"Observation.role must be 'user' or 'tool', got {self.role!r}")


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


def load_environment(reference: str) -> Callable[[], Environment]:
    """A factory of fresh environments for ``reference`` (see the module docstring)."""
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