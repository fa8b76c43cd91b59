"""Environments of the hubs as producer environments: OpenEnv environments (``openenv-core``) by name.

Consumes: ``producer.environment = "openenv:package.module:EnvClass"``, an OpenEnv server-side environment class
(a subclass of ``openenv.core.env_server.Environment``: ``reset(seed, episode_id) -> Observation``,
``step(action) -> Observation`` with ``done`` and ``reward``), run in the producer's process, no server, no Docker.
Produces: :func:`openenv_factory`, a factory of :class:`OpenEnvEpisode` objects with the producer's environment
interface (:mod:`producers.environment`): one OpenEnv instance per rollout,

    reset(prompt)      -> env.reset(seed=<from the prompt id and epoch>, episode_id="<prompt_id>/<epoch>")
    step(policy_text)  -> env.step(Action(<its text field>=policy_text)) -> Observation(text, done, reward)

where the action's text field is its first ``str`` field (``message``, ``guess``, ...) and the reply is the
observation's first ``str`` field (metadata, done and reward aside), or its other fields as compact JSON.
Guarantees:
- The environment's own reward (its rubric's output, ``Observation.reward``) is the step's reward: summed per
  episode into the rollout's ``metadata["episode_reward"]`` (:mod:`producers.multiturn`), scored by
  ``stream_rl.rewards.given:episode_reward``; a non-finite or non-numeric reward fails the episode's group.
- A class that is not an OpenEnv environment, or whose action has no ``str`` field, is refused at start-up with
  :class:`~producers.environment.EnvironmentLoadError` naming it; ``openenv-core`` missing names the extra.
- Calls run under ``producer.env_timeout_s`` like any environment's (:class:`~producers.environment.Guarded`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import typing
from collections.abc import Callable
from typing import Any

from producers.environment import EnvironmentLoadError, Observation
from schemas import Prompt
from stream_rl.runtime import references

PREFIX = "openenv:"
MAX_JSON_CHARS = 100_000


def openenv_factory(reference: str) -> Callable[[], OpenEnvEpisode]:
    """Fresh :class:`OpenEnvEpisode` objects for ``module:EnvClass`` (module docstring)."""
    try:
        from openenv.core.env_server.interfaces import Environment
    except ImportError:
        raise EnvironmentLoadError(f"producer.environment 'openenv:{reference}' needs openenv-core: pip install "
                                   f"'stream-rl[envs]' (or pip install openenv-core)") from None
    cls = references.resolve_reference(reference, what="producer.environment", error=EnvironmentLoadError,
                                       attr_label="Name")
    if not (inspect.isclass(cls) and issubclass(cls, Environment)):
        raise EnvironmentLoadError(f"producer.environment 'openenv:{reference}' is not an OpenEnv environment "
                                   f"class (a subclass of openenv.core.env_server.Environment)")
    action, field = _action_type(cls, reference)
    return lambda: OpenEnvEpisode(cls, action, field)


class OpenEnvEpisode:
    """One OpenEnv environment instance for one rollout (module docstring)."""

    def __init__(self, cls: type, action: type, field: str) -> None:
        self.cls, self.action, self.field = cls, action, field
        self.env: Any = None

    def reset(self, prompt: Prompt) -> None:
        self.env = self.cls()
        episode = f"{prompt.prompt_id}/{prompt.epoch}"
        kwargs = {"seed": episode_seed(episode), "episode_id": episode}
        accepted = inspect.signature(self.env.reset).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        self.env.reset(**kwargs)

    def step(self, policy_text: str) -> Observation:
        obs = self.env.step(self.action(**{self.field: policy_text}))
        reward = getattr(obs, "reward", None)
        if isinstance(reward, bool):
            reward = float(reward)
        return Observation(_text(obs), done=bool(getattr(obs, "done", False)), reward=reward,
                           tags={"env": self.cls.__name__})


def _action_type(cls: type, reference: str) -> tuple[type, str]:
    """The environment's action class (``step``'s annotation, else ``Environment[Action, ...]``'s first argument)
    and its first ``str`` field."""
    action = None
    try:
        action = typing.get_type_hints(cls.step).get("action")
    except Exception:  # an annotation that does not resolve: look at the generic base
        pass
    if not inspect.isclass(action):
        bases = [b for b in getattr(cls, "__orig_bases__", ()) if typing.get_args(b)]
        action = typing.get_args(bases[0])[0] if bases else None
    fields = getattr(action, "model_fields", None) if inspect.isclass(action) else None
    if not fields:
        raise EnvironmentLoadError(f"producer.environment 'openenv:{reference}': its action type is not known "
                                   f"(annotate step(self, action: MyAction) with a pydantic Action)")
    text = next((name for name, f in fields.items() if f.annotation is str and name != "metadata"), None)
    if text is None:
        raise EnvironmentLoadError(f"producer.environment 'openenv:{reference}': action {action.__name__} has no "
                                   f"str field to carry the policy's text (fields: {', '.join(fields)})")
    return action, text


def episode_seed(episode: str) -> int:
    """The seed an episode's environment is reset with: the first 4 bytes of sha256(``"<prompt_id>/<epoch>"``),
    little-endian (the same prompt and epoch give the same game in every run)."""
    return int.from_bytes(hashlib.sha256(episode.encode()).digest()[:4], "little")


def _text(obs: Any) -> str:
    """The reply of an observation object: :func:`observation_text` of its fields."""
    return observation_text({name: getattr(obs, name) for name in getattr(type(obs), "model_fields", {})
                             if name not in ("done", "reward", "metadata")})


def observation_text(values: dict[str, Any]) -> str:
    """The first ``str`` among an observation's fields (done, reward and metadata removed by the caller), else all of
    them as compact JSON, at most ``MAX_JSON_CHARS`` characters."""
    text = next((v for v in values.values() if isinstance(v, str)), None)
    if text is not None:
        return text
    return json.dumps(values, default=str, separators=(",", ":"))[:MAX_JSON_CHARS]
