"""Imports run one way: wire (schemas) <- core (stream_rl, but its CLI) <- roles (producers, consumers, evaluator)
<- CLI (stream_rl.cli) <- benchmarks (bench); no role imports another role, but the evaluator generates with the
producers' engines, config and weights follower, and only the CLI imports the evaluator; the deployment folder
(ops/) is imported by nobody; kafka-python is imported by the transport edge alone and OpenTelemetry by the tracing
edge and the metrics exporter alone. Every import counts: module level, inside functions (lazy) and under
``TYPE_CHECKING``. Each role (and the core) reads only its own config section: a read of another role's section
(``cfg.producer.dtype`` in the trainer) is named with its file and line.

The graph is read from the source (ast), so the test needs nothing installed and names each wrong-way import with
its file and line."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
from support.paths import REPO_ROOT

PACKAGES = ("schemas", "stream_rl", "producers", "consumers", "evaluator", "bench", "ops")
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
    if top in ("producers", "consumers", "evaluator"):
        return "roles"
    return {"bench": "bench", "ops": "deploy"}.get(top)


def role_of(module: str) -> str | None:
    """``producers``, ``consumers.scorer``, ``consumers.trainer`` or ``evaluator`` (None outside the roles)."""
    parts = module.split(".")
    if parts[0] in ("producers", "evaluator"):
        return parts[0]
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


EVALUATOR_MAY_IMPORT = ("producers.engines", "producers.config", "producers.weights_follower")
"""What the evaluator takes of another role: the producers' generation machinery (it generates as they do)."""


def role_import_allowed(importer: str, target: str) -> bool:
    """Whether ``importer`` may import ``target`` of another role: only the evaluator's generation machinery."""
    return role_of(importer) == "evaluator" and any(target == m or target.startswith(m + ".")
                                                    for m in EVALUATOR_MAY_IMPORT)


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
                elif role_of(importer) and role_of(target) and role_of(importer) != role_of(target) \
                        and not role_import_allowed(importer, target):
                    problems.append(where + ": a role never imports another role")
                elif role_of(target) == "evaluator" and here not in ("cli", "roles"):
                    problems.append(where + ": only the CLI imports the evaluator")
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
    for package in ("schemas", "stream_rl", "producers", "consumers", "evaluator"):
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
    ("producers/role.py", "consumers.scorer.scoring", "a role never imports another role"),
    ("producers/role.py", "evaluator.step", "a role never imports another role"),
    ("evaluator/role.py", "producers.step", "a role never imports another role"),
    ("bench/run.py", "evaluator.role", "only the CLI imports the evaluator"),
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


# -- each role reads only its own config section ---------------------------------------------------------------------

SECTION_FILES = {"producer": ("producers/config.py",), "scorer": ("consumers/scorer/config.py",),
                 "trainer": ("consumers/trainer/config*.py",), "eval": ("evaluator/config.py",),
                 "run": ("stream_rl/cli/config.py",)}
"""The root config's role sections (``run`` is ``stream-rl run``'s) and the files that declare their fields."""
WHOLE_SECTIONS = ("producer", "scorer", "trainer", "eval")
"""Sections also caught when read whole from a config (``cfg.producer``); ``run`` is too common a word for that
(``topics.run``, a tracker's ``self.run``): it is caught when one of its fields is read (``cfg.run.demo_dir``)."""
OWN_SECTIONS = {"producers": {"producer"}, "evaluator": {"eval"}, "consumers.scorer": {"scorer"},
                "consumers.trainer": {"trainer"}, "core": set()}
"""What each role (and the core, which serves every role) may read of the role sections: the CLI, the one layer
that holds the root config, hands a role its own section, the shared sections, and what it must agree on with
another role (``stream_rl.config.shared.Agreements``) as typed arguments."""


@functools.lru_cache(maxsize=None)
def section_fields() -> dict[str, frozenset[str]]:
    """{section: every field name declared (``name: type = ...``) in the files that declare it}, read with ast."""
    out = {}
    for section, patterns in SECTION_FILES.items():
        names = {node.target.id for pattern in patterns for path in REPO_ROOT.glob(pattern)
                 for node in ast.walk(ast.parse(path.read_text(), str(path)))
                 if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
        assert names, f"no fields found for section {section} in {patterns}"
        out[section] = frozenset(names)
    return out


def config_like(node: ast.expr) -> bool:
    """``cfg``, ``shared``, ``config``, ``self.cfg``, ``transport.cfg``, ``root_cfg``: an expression naming a config."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name is not None and (name.endswith("cfg") or name in ("config", "shared"))


def section_reads(source: str, own: set[str], filename: str = "<string>") -> list[tuple[int, str]]:
    """(line, expression) of every read of a role section other than ``own``: a field of it
    (``<anything>.trainer.max_lag``), the section whole from a config (``cfg.producer``), or
    ``getattr(cfg, "producer")``."""
    fields, found = section_fields(), []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            section = node.value.attr
            if section not in own and node.attr in fields.get(section, ()):
                found.append((node.lineno, ast.unparse(node)))
        if isinstance(node, ast.Attribute) and node.attr in WHOLE_SECTIONS and node.attr not in own \
                and config_like(node.value):
            found.append((node.lineno, ast.unparse(node)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and node.args[1].value in SECTION_FILES and node.args[1].value not in own:
            found.append((node.lineno, ast.unparse(node)))
    found = set(found)  # a field read also holds the section read whole: name the longest
    return sorted(hit for hit in found if not any(o[0] == hit[0] and o[1].startswith(hit[1] + ".") for o in found))


def reader_of(module: str) -> str | None:
    """The key of ``OWN_SECTIONS`` for a module (None: the CLI, benchmarks, tests: they may read the root)."""
    parts = module.split(".")
    if parts[0] in ("producers", "evaluator"):
        return parts[0]
    if parts[0] == "consumers" and len(parts) > 1:
        return f"consumers.{parts[1]}"
    return "core" if layer_of(module) == "core" else None


def foreign_section_reads() -> list[str]:
    problems = []
    for package in ("stream_rl", "producers", "consumers", "evaluator"):
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            reader = reader_of(module_name(path))
            if reader is None:
                continue
            own = OWN_SECTIONS.get(reader, set())
            for line, text in section_reads(path.read_text(), own, str(path)):
                problems.append(f"{path.relative_to(REPO_ROOT)}:{line}: {reader} reads {text}: take it as a typed "
                                f"argument from the CLI (own section, or stream_rl.config.shared.Agreements)")
    return problems


def test_each_role_reads_only_its_own_config_section():
    assert foreign_section_reads() == []


@pytest.mark.parametrize(("source", "own", "expected"), [
    ("w = cfg.producer.dtype", {"trainer"}, [(1, "cfg.producer.dtype")]),  # a field through the root
    ("x = 1\nd = self.cfg.trainer.checkpoint_dir", set(), [(2, "self.cfg.trainer.checkpoint_dir")]),
    ("e = build_engine(cfg.producer)", {"eval"}, [(1, "cfg.producer")]),  # the section whole
    ("s = shared.scorer", {"trainer"}, [(1, "shared.scorer")]),
    ("d = cfg.run.demo_dir", {"producer"}, [(1, "cfg.run.demo_dir")]),
    ("t = getattr(cfg, 'trainer')", {"scorer"}, [(1, "getattr(cfg, 'trainer')")]),
    ("m = cfg.trainer.model_dir", {"trainer"}, []),  # its own section
    ("k = cfg.weights.keep_last; r = cfg.topics.run; self.run.log({})", set(), []),  # shared sections, a word
    ("e = engine_cfg.model_dir; t = tcfg.max_lag", set(), []),  # typed arguments handed over by the CLI
])
def test_the_section_rule_flags_a_foreign_read(source, own, expected):
    """The rule itself, on small sources: what a role may not read, and what it may."""
    assert section_reads(source, own) == expected


def test_a_foreign_section_read_is_named(monkeypatch):
    """A planted read of the producer's section in the trainer fails the repository check, naming file and line."""
    planted = REPO_ROOT / "consumers" / "trainer" / "versions.py"
    original = Path.read_text

    def read_text(self: Path, *args, **kwargs) -> str:
        text = original(self, *args, **kwargs)
        return text + "\ndtype = self.cfg.producer.dtype\n" if self == planted else text

    monkeypatch.setattr(Path, "read_text", read_text)
    problems = foreign_section_reads()
    assert len(problems) == 1 and problems[0].startswith("consumers/trainer/versions.py:")
    assert "consumers.trainer reads self.cfg.producer.dtype" in problems[0]
