"""``package.module:name`` references to user code (reward functions, environments): parse, import, resolve.

Consumes: a reference string from the config, the label the config knows it by (``reward function reference``,
``producer.environment``) and the role's own error type. Produces: the object the reference names.
Guarantees: every failure raises the caller's error type (a ``ValueError``) in one line that names the reference
and what is wrong with it: not exactly one ``:``, a part that is not a dotted Python name, a module that is not
importable (or whose own code raised while importing), an attribute the module lacks. Nothing is imported before
the reference parses.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def parse_reference(reference: Any, *, what: str, error: type[ValueError], attr_label: str) -> tuple[str, str]:
    """``"pkg.mod:attr"`` -> ``("pkg.mod", "attr")``; raises ``error`` on a malformed reference."""
    if not isinstance(reference, str) or reference.count(":") != 1:
        raise error(f"{what} {reference!r} must look like 'package.module:{attr_label}' (exactly one ':')")
    module, attr = (part.strip() for part in reference.split(":"))
    for label, part in (("module", module), (attr_label, attr)):
        if not _DOTTED.match(part):
            raise error(f"{what} {reference!r}: {label} part {part!r} is not a dotted Python name")
    return module, attr


def resolve_reference(reference: Any, *, what: str, error: type[ValueError], attr_label: str) -> Any:
    """The object ``reference`` names: its module imported, then each dotted part of the name looked up."""
    module_name, attr = parse_reference(reference, what=what, error=error, attr_label=attr_label)
    obj: Any = _import(reference, module_name, what, error)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(f"{what} {reference!r}: module {module_name!r} has no attribute {attr!r} ({part!r} not "
                        f"found)")
        obj = getattr(obj, part)
    return obj


def _import(reference: str, module_name: str, what: str, error: type[ValueError]) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (exc.name == module_name or module_name.startswith(exc.name + ".")):
            raise error(f"{what} {reference!r}: module {module_name!r} not found ({exc.name!r} is not "
                        f"importable)") from exc
        raise error(f"{what} {reference!r}: importing module {module_name!r} failed: {exc!r}") from exc
    except Exception as exc:  # the module exists but its own code raised while importing
        raise error(f"{what} {reference!r}: importing module {module_name!r} failed: {exc!r}") from exc
