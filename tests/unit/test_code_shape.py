"""Code shape: no function or method of the product over 60 lines, no module over 400.

The product packages (``stream_rl``, ``producers``, ``consumers``, ``schemas``, ``ops``, and ``evaluator`` where it
exists) are read from the source (ast), so the test needs nothing installed. A function's length is
``end_lineno - lineno + 1`` (its decorators not counted); a nested function counts on its own and inside its parent.
Each failure names the file, the function and its length."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from support.paths import REPO_ROOT

PACKAGES = ("stream_rl", "producers", "consumers", "schemas", "ops", "evaluator")
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400


def product_files() -> list[Path]:
    """Every ``.py`` file of the product packages that exist in this checkout."""
    return sorted(p for pkg in PACKAGES if (REPO_ROOT / pkg).is_dir() for p in (REPO_ROOT / pkg).rglob("*.py"))


def functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Each function and method with its qualified name (``Class.method``, ``outer.inner``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        else:
            yield from functions(node, prefix)


def shape_faults(files: list[Path], root: Path = REPO_ROOT) -> list[str]:
    """One line per module over ``MAX_MODULE_LINES`` and per function over ``MAX_FUNCTION_LINES``, each naming the
    file (relative to ``root``)."""
    faults = []
    for path in files:
        source = path.read_text()
        name = path.relative_to(root).as_posix()
        lines = len(source.splitlines())
        if lines > MAX_MODULE_LINES:
            faults.append(f"{name}: module of {lines} lines (at most {MAX_MODULE_LINES})")
        for qualname, node in functions(ast.parse(source, filename=name)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                faults.append(f"{name}::{qualname}: function of {length} lines (at most {MAX_FUNCTION_LINES})")
    return faults


def test_no_function_over_60_lines_and_no_module_over_400():
    faults = shape_faults(product_files())
    assert not faults, "code over its shape limits:\n" + "\n".join(faults)


def test_an_oversized_function_and_module_are_named(tmp_path):
    """The check fails on a planted long method and long module, naming the file, the function and the length."""
    planted = tmp_path / "consumers" / "loop.py"
    planted.parent.mkdir()
    body = "".join(f"        x{i} = {i}\n" for i in range(60))
    planted.write_text("class Loop:\n    def step(self):\n" + body + "\n" * 341 + "def short():\n    return 1\n")
    assert shape_faults([planted], root=tmp_path) == [
        "consumers/loop.py: module of 405 lines (at most 400)",
        "consumers/loop.py::Loop.step: function of 61 lines (at most 60)"]
