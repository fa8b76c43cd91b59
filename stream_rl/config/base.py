"""The base class of every config section (kept apart so role packages can define their sections), the device
setting every role that runs a model shares, and the rendering of validation errors for a person.

Consumes: pydantic models and their :class:`~pydantic.ValidationError`.
Produces: :class:`Section`; :func:`render_errors`, the text of an invalid config: one line per error, each naming
the dotted field and where its value came from, an unknown field with the nearest valid name (difflib), an unknown
``STREAM_RL_*`` variable with the variable to use instead.
Guarantees: every error of a validation is shown (none hidden behind a count); one error is one line.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, get_args

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"
"""What a role's ``device`` setting accepts: ``auto`` (resolved by :func:`stream_rl.models.devices.resolve_device`:
CUDA when torch sees a GPU, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""

ENV_PREFIX = "STREAM_RL_"


class ConfigError(ValueError):
    """A configuration value is invalid; ``str(err)`` names the field, one line per error."""


class Section(BaseModel):
    """A config section: unknown fields are errors, assignments are validated, and a field listed in ``REMOVED``
    is refused with its own message (what replaced it) instead of the generic unknown-field error."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    REMOVED: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _removed_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, message in cls.REMOVED.items():
                if name in data:
                    raise ValueError(message)
        return data


class CrossFieldError(ValueError):
    """A rule across sections is broken; ``fields`` are the dotted names it involves (their sources get named)."""

    def __init__(self, fields: Sequence[str], message: str) -> None:
        super().__init__(message)
        self.fields = tuple(fields)


def sections_of(annotation: Any) -> list[type[BaseModel]]:
    """The config sections (BaseModel classes) an annotation may hold (``X``, ``X | None``, a union of several)."""
    kinds = get_args(annotation) or (annotation,)
    return [k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)]


def field_names(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted names of every field of ``model`` and of its sections (``kafka.bootstrap_servers``, ...)."""
    names = []
    for name, field in model.model_fields.items():
        names.append(prefix + name)
        for section in sections_of(field.annotation):
            names += field_names(section, f"{prefix}{name}.")
    return names


def env_name(dotted: str) -> str:
    """``kafka.bootstrap_servers`` -> ``STREAM_RL_KAFKA__BOOTSTRAP_SERVERS``."""
    return ENV_PREFIX + dotted.upper().replace(".", "__")


def nearest(dotted: str, names: Sequence[str]) -> str | None:
    """The valid dotted name closest to a misspelt one (None when nothing is close); separators do not count, so
    ``kafka_bootstrap_servers`` (one underscore in an environment variable) finds ``kafka.bootstrap_servers``."""
    def flat(name: str) -> str:
        return name.lower().replace(".", "_")

    by_flat = {flat(n): n for n in names}
    match = difflib.get_close_matches(flat(dotted), list(by_flat), n=1, cutoff=0.75)
    return by_flat[match[0]] if match else None


def render_errors(exc: ValidationError, sources: Mapping[str, str], default_origin: str,
                  names: Sequence[str]) -> str:
    """Every error of ``exc``: one line when there is one, else a count and one indented line per error."""
    lines: list[str] = []
    for err in exc.errors():
        line = _error_line(err, sources, default_origin, names)
        if line not in lines:
            lines.append(line)
    if len(lines) == 1:
        return f"invalid config: {lines[0]}"
    return f"invalid config ({len(lines)} errors):\n" + "\n".join(f"  {line}" for line in lines)


def _error_line(err: Mapping[str, Any], sources: Mapping[str, str], default_origin: str,
                names: Sequence[str]) -> str:
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, CrossFieldError):  # a rule across sections: name each field's own source
        origins = ", ".join(f"{name} from {sources.get(name, 'defaults')}" for name in cause.fields)
        return f"{cause} [{origins}]"
    loc = [str(p) for p in err["loc"]]
    field = ".".join(loc) or "<root>"
    # a section's own check (a model validator) fails at the section: name the sources of the keys set under it;
    # an item of a list or map fails below the key that set it
    under = sorted({v for k, v in sources.items() if k.startswith(field + ".")})
    above = next((sources[k] for k in (".".join(loc[:i]) for i in range(len(loc) - 1, 0, -1)) if k in sources), None)
    origin = sources.get(field) or ", ".join(under) or above or default_origin
    if err["type"] == "extra_forbidden":
        return f"{field}: unknown field [from {origin}]{_did_you_mean(field, origin, names)}"
    msg = err["msg"].removeprefix("Value error, ")
    return f"{field}: {msg} [from {origin}]"


def _did_you_mean(field: str, origin: str, names: Sequence[str]) -> str:
    guess = nearest(field, names)
    from_env = origin.startswith("env ")
    if guess is None:
        return "; unset this variable (STREAM_RL_* variables set config fields)" if from_env else ""
    return f"; did you mean {env_name(guess)} ({guess})?" if from_env else f"; did you mean {guess}?"
