"""The edge as the role loops configure it (:class:`~stream_rl.transport.edge.Source`), on the in-process bus: through
its constructor (``Transport.source``: ``pause_when``, ``keep_rejections``), never by a role setting attributes on
it afterwards."""

from __future__ import annotations

import ast
from pathlib import Path

from support import messages as samples

from stream_rl.transport.client import Transport

REPO = Path(__file__).resolve().parents[2]
CONFIGURED = {"paused", "rejections", "observer"}  # the edge's options: given to its constructor


def _transport(make_config) -> Transport:
    t = Transport(make_config(**{"topics.partitions.prompts": 1}), "unit")
    t.ensure_topics()
    return t


def test_a_source_paused_by_its_predicate_fetches_nothing_and_resumes_where_it_stood(make_config):
    t = _transport(make_config)
    sink = t.sink()
    for i in range(3):
        p = samples.prompt(i)
        sink.send(t.names.prompts, p, key=p.prompt_id)
    sink.flush()
    pause = [True]
    source = t.source([t.names.prompts], "g", "prompt", sink, pause_when=lambda: pause[0])
    source.unsubscribe()
    source.assign({(t.names.prompts, 0): 0})  # as the trainer reads (a subscriber learns its partitions in a poll)
    assert source.paused and [source.poll(0.01) for _ in range(3)] == [[], [], []]
    pause[0] = False
    assert not source.paused and [r.offset for r in source.poll(0.01)] == [0, 1, 2]
    source.close()


def test_kept_rejections_are_taken_once_and_a_source_without_them_keeps_none(make_config):
    t = _transport(make_config)
    sink = t.sink()
    for i in range(2):
        sink.send_raw(t.names.prompts, b"\xc1 not msgpack", key=f"k{i}".encode())
    sink.flush()
    keeping = t.source([t.names.prompts], "keeps", "prompt", sink, keep_rejections=True)
    assert keeping.poll(0.01) == [] and keeping.dead_lettered == 2
    taken = keeping.take_rejections()
    assert [(r.offset, r.error_type) for r in taken] == [(0, "SchemaError"), (1, "SchemaError")]
    assert keeping.take_rejections() == []
    plain = t.source([t.names.prompts], "plain", "prompt", sink)
    assert plain.poll(0.01) == [] and plain.dead_lettered == 2 and plain.take_rejections() == []
    keeping.close()
    plain.close()


def _edge_option_assignments(path: Path) -> list[str]:
    """``<object>.<option> = ...`` outside ``self``, for the edge's options (``CONFIGURED``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = node.targets if isinstance(node, ast.Assign) else []
        for target in (t for tg in targets for t in (tg.elts if isinstance(tg, ast.Tuple) else [tg])):
            if isinstance(target, ast.Attribute) and target.attr in CONFIGURED and not (
                    isinstance(target.value, ast.Name) and target.value.id == "self"):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {ast.unparse(target)}")
    return found


def test_no_role_sets_an_edge_option_after_building_it():
    roles = sorted((REPO / "producers").rglob("*.py")) + sorted((REPO / "consumers").rglob("*.py"))
    assert roles and [hit for path in roles for hit in _edge_option_assignments(path)] == []
