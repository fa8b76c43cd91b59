"""Imports run one way: wire (schemas) <- core (stream_rl, but its CLI) <- roles (producers, consumers) <- CLI
(stream_rl.cli) <- benchmarks (bench); no role imports another role; the deployment folder (ops/) is imported by
nobody; kafka-python is imported by the transport edge alone and OpenTelemetry by the tracing edge and the metrics
exporter alone. Every import counts: module level, inside functions (lazy) and under ``TYPE_CHECKING``.

The graph is read from the source (ast), so the test needs nothing installed and names each wrong-way import with
its file and line."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
from support.paths import REPO_ROOT

PACKAGES = ("schemas", "stream_rl", "producers", "consumers", "bench", "ops")
LAYERS = {"wire": 0, "core": 1, "roles": 2, "cli": 3, "bench": 4, "deploy": 5}


def layer_of(module: str) -> str | None:
    """The layer of a module of this repository (None: a third-party or standard-library module)."""
    top = module.split(".")[0]
    if top == "schemas":
        return "wire"
    if module == "stream_rl.cli" or module.startswith("stream_rl.cli."):
        return "cli"
    if top == "stream_rl":
        return "core"
    if top in ("producers", "consumers"):
        return "roles"
    return {"bench": "bench", "ops": "deploy"}.get(top)


def role_of(module: str) -> str | None:
    """``producers``, ``consumers.scorer`` or ``consumers.trainer`` (None outside the roles)."""
    parts = module.split(".")
    if parts[0] == "producers":
        return "producers"
    if parts[0] == "consumers" and len(parts) > 1:
        return f"consumers.{parts[1]}"
    return None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[str, int]]:
    """Every module ``path`` imports (absolute names, relative imports resolved) with the line of the import."""
    return list(_imports_of(path))


@functools.lru_cache(maxsize=None)
def _imports_of(path: Path) -> tuple[tuple[str, int], ...]:
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, node.lineno))
            # `from pkg import mod` imports the module pkg.mod when there is one
            found += [(f"{target}.{alias.name}", node.lineno) for alias in node.names
                      if _is_module(f"{target}.{alias.name}")]
    return tuple(found)


def _is_module(dotted: str) -> bool:
    base = REPO_ROOT.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def wrong_way_imports() -> list[str]:
    problems = []
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            importer = module_name(path)
            here = layer_of(importer)
            for target, line in imports_of(path):
                there = layer_of(target)
                where = f"{path.relative_to(REPO_ROOT)}:{line}: {importer} ({here}) imports {target} ({there})"
                if there is not None and LAYERS[there] > LAYERS[here]:
                    problems.append(where)
                elif there == "deploy" and here != "deploy":
                    problems.append(where + ": nothing imports the deployment folder")
                elif role_of(importer) and role_of(target) and role_of(importer) != role_of(target):
                    problems.append(where + ": a role never imports another role")
    return problems


def test_imports_run_one_way():
    assert wrong_way_imports() == []


EDGES = {
    "kafka": ("stream_rl.transport",),  # kafka-python: the transport edge alone
    "opentelemetry": ("stream_rl.transport.tracing", "stream_rl.telemetry.metrics"),  # spans at the edge, metrics
}
"""Third-party clients that only their edge module may import (within the product: wire, core, roles, CLI)."""


def edge_leaks() -> list[str]:
    leaks = []
    for package in ("schemas", "stream_rl", "producers", "consumers"):
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            importer = module_name(path)
            for target, line in imports_of(path):
                top = target.split(".")[0]
                allowed = EDGES.get(top)
                if allowed and not any(importer == a or importer.startswith(a + ".") for a in allowed):
                    leaks.append(f"{path.relative_to(REPO_ROOT)}:{line}: {importer} imports {target}; only "
                                 f"{', '.join(allowed)} may")
    return leaks


def test_kafka_python_and_opentelemetry_stay_at_their_edges():
    assert edge_leaks() == []


def test_an_edge_leak_is_named(monkeypatch):
    planted = REPO_ROOT / "consumers" / "trainer" / "trainer.py"
    original = imports_of
    monkeypatch.setitem(globals(), "imports_of",
                        lambda path: original(path) + [("kafka.structs", 7)] if path == planted else original(path))
    assert edge_leaks() == ["consumers/trainer/trainer.py:7: consumers.trainer.trainer imports kafka.structs; only "
                            "stream_rl.transport may"]


@pytest.mark.parametrize(("importer", "target", "why"), [
    ("stream_rl/transport/edge.py", "consumers.trainer.config", "core"),
    ("schemas/messages.py", "stream_rl.transport", "wire"),
    ("stream_rl/cli/main.py", "bench.run", "cli"),
    ("producers/generator.py", "consumers.scorer.scoring", "a role never imports another role"),
])
def test_a_wrong_way_import_is_named(tmp_path, monkeypatch, importer, target, why):
    """The check fails on a planted wrong-way import, naming the file, the line and both layers."""
    planted = REPO_ROOT / importer
    source = planted.read_text() if planted.is_file() else ""
    original = imports_of

    def with_plant(path: Path):
        found = original(path)
        return found + [(target, 9999)] if path == planted else found

    monkeypatch.setitem(globals(), "imports_of", with_plant)
    problems = [p for p in wrong_way_imports() if p.startswith(f"{importer}:9999:")]
    assert len(problems) == 1 and target in problems[0] and why in problems[0], problems
    assert planted.read_text() == source  # nothing was written
