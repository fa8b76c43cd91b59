"""One loader of ``package.module:name`` references serves the scorer's reward functions and the producer's
environments: each failure is one line naming the reference and what is wrong, in the caller's error type."""

from __future__ import annotations

import pytest

from stream_rl.runtime.references import parse_reference, resolve_reference


class Wrong(ValueError):
    pass


def resolve(reference):
    return resolve_reference(reference, what="thing", error=Wrong, attr_label="Name")


def test_a_reference_resolves_through_dotted_attributes():
    import os.path

    assert resolve("os:path.join") is os.path.join
    assert parse_reference(" a.b : c.d ", what="thing", error=Wrong, attr_label="Name") == ("a.b", "c.d")


@pytest.mark.parametrize(("reference", "message"), [
    ("nocolon", "thing 'nocolon' must look like 'package.module:Name' (exactly one ':')"),
    (None, "thing None must look like"),
    ("a:b:c", "exactly one ':'"),
    ("1a:b", "thing '1a:b': module part '1a' is not a dotted Python name"),
    ("a:b-c", "Name part 'b-c' is not a dotted Python name"),
    ("no_such_module_xyz.sub:f", "module 'no_such_module_xyz.sub' not found ('no_such_module_xyz' is not importable)"),
    ("os:no_such_attr", "thing 'os:no_such_attr': module 'os' has no attribute 'no_such_attr'"),
    ("os:path.nope", "has no attribute 'path.nope' ('nope' not found)"),
])
def test_each_failure_names_the_reference_and_the_problem(reference, message):
    with pytest.raises(Wrong) as err:
        resolve(reference)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_module_whose_code_raises_is_reported_as_failing_to_import(tmp_path, monkeypatch):
    (tmp_path / "ref_broken_module.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(Wrong, match=r"importing module 'ref_broken_module' failed: RuntimeError\('boom at import'\)"):
        resolve("ref_broken_module:f")
