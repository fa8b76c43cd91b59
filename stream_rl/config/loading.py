"""Loading a configuration: defaults, then a file, then the environment, then CLI flags, into any root model.

Consumes: an optional TOML or YAML file, ``STREAM_RL_*`` environment variables and ``--set key=value`` overrides.
Produces: a validated instance of the root model it is given (the CLI's is
:class:`stream_rl.cli.config.StreamRLConfig`, which every role's section composes).
Guarantees: precedence is defaults < file < environment < flags; an invalid config raises :class:`ConfigError`
listing every error, one line each, naming the dotted field and where the value came from (an unknown field or
``STREAM_RL_*`` variable also names the nearest valid one: a typo is never ignored); setting one key of a map
field from the environment or a flag (``topics.partitions.rollouts=8``) merges into the map (the file's, else the
default) instead of replacing it; secrets are ``SecretStr`` and never printed in clear (``dump_config`` masks them).

Environment variables map onto nested fields with ``__`` between levels, e.g.
``STREAM_RL_KAFKA__BOOTSTRAP_SERVERS=host:9092`` sets ``kafka.bootstrap_servers``. ``STREAM_RL_CONFIG`` names the
config file and ``STREAM_RL_DEBUG`` is the CLI's ``--debug``; neither is a field. Values of variables and ``--set``
are parsed by :func:`parse_value`: one that opens with ``{`` or ``[`` as TOML (``{enable_thinking = false}`` is a
table, as in the config file; a malformed one is refused naming the flag or variable), any other as a YAML scalar
(``4`` is an int, ``true`` a bool).
"""

from __future__ import annotations

import copy
import json
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, SecretStr, ValidationError

from stream_rl.config.base import ENV_PREFIX, ConfigError, field_names, render_errors, sections_of

ENV_CONFIG_FILE = "STREAM_RL_CONFIG"
ENV_DEBUG = "STREAM_RL_DEBUG"
NOT_FIELDS = (ENV_CONFIG_FILE, ENV_DEBUG)
"""``STREAM_RL_*`` variables that are not config fields."""



def parse_value(text: str, origin: str) -> Any:
    """An environment variable's or flag's value (``origin`` names it in errors).

    A value that opens like a TOML inline table or array (``{`` or ``[``) is read as TOML, the syntax of the config
    file: ``{enable_thinking = false}`` is that table, never a YAML key named ``enable_thinking = false``. When it
    is not TOML, a YAML flow collection without ``=`` (``{a: 1}``, ``[a, b]``) is still read as YAML; anything
    else is a :class:`ConfigError` naming ``origin`` and the TOML error. Every other value is a YAML scalar
    (``4`` an int, ``true`` a bool, ``text`` a string).
    """
    head = text.lstrip()[:1]
    if head not in ("{", "["):
        try:
            return yaml.safe_load(text) if text.strip() else text
        except yaml.YAMLError:
            return text
    try:
        return tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError as exc:
        toml_error = str(exc)
    kind = "inline table {key = value, ...}" if head == "{" else "array [value, ...]"
    if "=" not in text:
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            pass
    raise ConfigError(f"invalid {origin}: {text.strip()[:120]!r} is not a TOML {kind} ({toml_error}); "
                      f"strings inside it need quotes, e.g. {{name = \"x\", on = true}}")


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = [p for p in dotted.split(".") if p]
    if not parts:
        raise ConfigError(f"invalid config key {dotted!r}: empty")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"invalid config key {dotted!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def read_config_file(path: Path) -> dict[str, Any]:
    """Read a TOML (.toml) or YAML (.yaml/.yml) config file into a plain dict."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError(f"config file {path}: unknown format (use .toml, .yaml or .yml)")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {path}: {str(exc).splitlines()[0]}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a table/mapping")
    return data


def env_overrides(env: Mapping[str, str]) -> dict[str, str]:
    """``STREAM_RL_A__B=v`` -> ``{"a.b": "v"}`` (the config-file variable excluded)."""
    out = {}
    for name, value in env.items():
        if name.startswith(ENV_PREFIX) and name not in NOT_FIELDS:
            out[name[len(ENV_PREFIX):].lower().replace("__", ".")] = value
    return out


def parse_sets(sets: Sequence[str]) -> dict[str, str]:
    """``["kafka.acks=1"]`` -> ``{"kafka.acks": "1"}``; a malformed item raises ConfigError."""
    out = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"invalid --set {item!r}: expected KEY=VALUE")
        out[key.strip()] = value
    return out


def resolve_config(
    path: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    model: type[BaseModel],
) -> Any:
    """Resolve a config: defaults < file < environment < ``overrides`` (CLI flags, dotted keys)."""
    env = os.environ if env is None else env
    if path is None and env.get(ENV_CONFIG_FILE):
        path = Path(env[ENV_CONFIG_FILE])
    tree: dict[str, Any] = read_config_file(path) if path is not None else {}
    sources: dict[str, str] = {key: f"file {path}" for key in _leaf_keys(tree)}
    secrets = secret_fields(model)  # kept verbatim: a password "123456" or "null" is text, not YAML
    maps = map_defaults(model)
    for key, raw in env_overrides(env).items():
        _seed_map(tree, maps, key)
        variable = f"{ENV_PREFIX}{key.upper().replace('.', '__')}"
        _set_path(tree, key, raw if key in secrets else parse_value(raw, variable))
        sources[key] = f"env {variable}"
    for key, value in (overrides or {}).items():
        _seed_map(tree, maps, key)
        parsed = parse_value(value, f"--set {key}") if isinstance(value, str) and key not in secrets else value
        _set_path(tree, key, parsed)
        sources[key] = "flag"
    try:
        return model.model_validate(tree)
    except ValidationError as exc:
        origin = f"file {path}" if path else "defaults"
        raise ConfigError(render_errors(exc, sources, origin, field_names(model))) from None


def map_defaults(model: type[BaseModel], prefix: str = "") -> dict[str, dict]:
    """Dotted name -> default of every map (``dict``) field of ``model`` and its sections."""
    found: dict[str, dict] = {}
    for name, field in model.model_fields.items():
        kinds = (field.annotation,) if get_origin(field.annotation) is dict else get_args(field.annotation)
        if any(get_origin(kind) is dict for kind in kinds):  # dict[...] or dict[...] | None
            found[prefix + name] = field.get_default(call_default_factory=True) or {}
        for section in sections_of(field.annotation):
            found |= map_defaults(section, f"{prefix}{name}.")
    return found


def _seed_map(tree: dict[str, Any], maps: Mapping[str, dict], key: str) -> None:
    """Before ``key`` sets one entry of a map field, put the map's default in ``tree`` unless a value is there
    already (the file's): ``topics.partitions.rollouts=8`` keeps the other topics' partition counts."""
    for dotted, default in maps.items():
        if key.startswith(dotted + ".") and _get_path(tree, dotted) is None:
            _set_path(tree, dotted, copy.deepcopy(default))


def _get_path(tree: Mapping[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _leaf_keys(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of the leaves of a nested mapping (``{"a": {"b": 1}}`` -> ``["a.b"]``)."""
    keys = []
    for name, value in tree.items():
        keys += _leaf_keys(value, f"{prefix}{name}.") if isinstance(value, Mapping) else [f"{prefix}{name}"]
    return keys


def secret_fields(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Dotted names of every ``SecretStr`` field of ``model`` and its sections."""
    found = set()
    for name, field in model.model_fields.items():
        for kind in get_args(field.annotation) or (field.annotation,):
            if kind is SecretStr:
                found.add(prefix + name)
            elif isinstance(kind, type) and issubclass(kind, BaseModel):
                found |= secret_fields(kind, f"{prefix}{name}.")
    return found


def dump_config(cfg: BaseModel) -> str:
    """The resolved config as pretty JSON, secrets masked."""
    return json.dumps(cfg.model_dump(mode="json"), indent=2, sort_keys=True)
