"""Span trees from a run's ``spans.jsonl``, for ``stream-rl trace show`` (no tracing backend needed).

Consumes: ``RUN_DIR/spans.jsonl``, one JSON object per finished span as :func:`stream_rl.transport.tracing.span_to_dict`
writes it (``name``, ``trace_id``, ``span_id``, ``parent_id``, ``start_ns``, ``end_ns``, ``attributes``,
``links``, ``service``); every role process of a run appends to the same file when ``tracing.exporter=jsonl``.
Produces: text: a summary (per span name: count, p50 and p95 duration) and the newest traces as trees, or, for one
rollout, its lineage and the training steps that consumed it::

    process generate [producer] 812.4 ms  batch=8
    └─ send stream-rl.demo.rollouts [producer] 0.3 ms  rollout_id=add-1-2:0:3 group_id=add-1-2:0 ...
       └─ process score [scorer] 1.2 ms
          └─ send stream-rl.demo.scored [scorer] 0.2 ms  rollout_id=add-1-2:0:3 reward=1.0 ...
    linked from:
    process train-step [trainer] 95.0 ms  step=3 policy_version=3 rollouts=256 ...

Guarantees: pure functions over span dicts (the CLI only reads the file and prints); a line torn by a process
still writing is skipped; spans whose parent is not in the file are roots. A rollout's view keeps, in each trace
holding a span with its ``stream_rl.rollout_id``, those spans' ancestors and descendants only (a batch root's
other children are left out), plus every span with a link to one of them (the trainer's ``train-step``).
Attribute values shown are those the spans carry: ids, versions, counts, rewards, never sample text.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

SPAN_FILE = "spans.jsonl"
ROLLOUT_ATTR = "stream_rl.rollout_id"
_HIDDEN_ATTRS = {"messaging.system", "messaging.destination.name", "stream_rl.kind"}


class TraceViewError(RuntimeError):
    """The span file is missing or holds no spans."""


def load_spans(path: Path) -> list[dict[str, Any]]:
    """The spans of ``path`` (a run directory or the file itself); torn lines are skipped."""
    path = Path(path)
    file = path / SPAN_FILE if path.is_dir() else path
    if not file.is_file():
        raise TraceViewError(f"no span file {file}: spans are written there when the run has "
                             "tracing.exporter=jsonl (e.g. --set tracing.exporter=jsonl)")
    spans = []
    for line in file.read_text().splitlines():
        try:
            span = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(span, dict) and "span_id" in span and "trace_id" in span:
            spans.append(span)
    if not spans:
        raise TraceViewError(f"{file} holds no spans")
    return spans


def duration_ms(span: dict[str, Any]) -> float:
    return ((span.get("end_ns") or 0) - (span.get("start_ns") or 0)) / 1e6


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile, linear between closest ranks (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary(spans: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per span name: count, p50 and p95 duration (ms), sorted by name."""
    by_name: dict[str, list[float]] = defaultdict(list)
    for span in spans:
        by_name[span["name"]].append(duration_ms(span))
    return [{"name": name, "count": len(d), "p50_ms": percentile(d, 50), "p95_ms": percentile(d, 95)}
            for name, d in sorted(by_name.items())]


class SpanIndex:
    """Spans by id, children by parent, and which spans link to which."""

    def __init__(self, spans: Iterable[dict[str, Any]]):
        self.spans = sorted(spans, key=lambda s: s.get("start_ns") or 0)
        self.by_id = {s["span_id"]: s for s in self.spans}
        self.children: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.linked_from: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for span in self.spans:
            parent = span.get("parent_id")
            if parent and parent in self.by_id:
                self.children[parent].append(span)
            for link in span.get("links") or []:
                self.linked_from[link["span_id"]].append(span)

    def is_root(self, span: dict[str, Any]) -> bool:
        return not span.get("parent_id") or span["parent_id"] not in self.by_id

    def roots(self) -> list[dict[str, Any]]:
        return [s for s in self.spans if self.is_root(s)]

    def ancestors(self, span: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        while not self.is_root(span):
            span = self.by_id[span["parent_id"]]
            out.append(span)
        return out

    def descendants(self, span: dict[str, Any]) -> list[dict[str, Any]]:
        out, todo = [], list(self.children.get(span["span_id"], []))
        while todo:
            child = todo.pop()
            out.append(child)
            todo.extend(self.children.get(child["span_id"], []))
        return out


def describe(span: dict[str, Any]) -> str:
    """One line: name, service, duration, and the span's attributes without the ``stream_rl.`` prefix."""
    attrs = []
    for key, value in sorted((span.get("attributes") or {}).items()):
        if key in _HIDDEN_ATTRS:
            continue
        short = key.removeprefix("stream_rl.").replace("messaging.batch.message_count", "batch")
        attrs.append(f"{short}={round(value, 4) if isinstance(value, float) else value}")
    links = len(span.get("links") or [])
    tail = ("  " + " ".join(attrs) if attrs else "") + (f"  links={links}" if links else "")
    return f"{span['name']} [{span.get('service') or '?'}] {duration_ms(span):.1f} ms{tail}"


def render_tree(index: SpanIndex, root: dict[str, Any], keep: set[str] | None = None,
                max_children: int | None = None) -> list[str]:
    """The tree under ``root`` as text lines; only spans in ``keep`` (when given); at most ``max_children``
    children shown per span (the rest counted)."""
    lines = [describe(root)]

    def walk(span: dict[str, Any], prefix: str) -> None:
        kids = [c for c in index.children.get(span["span_id"], []) if keep is None or c["span_id"] in keep]
        shown = kids if max_children is None else kids[:max_children]
        hidden = len(kids) - len(shown)
        for i, child in enumerate(shown):
            last = i == len(shown) - 1 and not hidden
            lines.append(prefix + ("└─ " if last else "├─ ") + describe(child))
            walk(child, prefix + ("   " if last else "│  "))
        if hidden:
            lines.append(prefix + f"└─ ... {hidden} more")

    walk(root, "")
    return lines


def rollout_view(spans: Iterable[dict[str, Any]], rollout_id: str) -> list[str]:
    """The lineage of ``rollout_id`` in every trace that carries it, then the spans linking to it."""
    index = SpanIndex(spans)
    hits = [s for s in index.spans if (s.get("attributes") or {}).get(ROLLOUT_ATTR) == rollout_id]
    if not hits:
        raise TraceViewError(f"no span carries {ROLLOUT_ATTR}={rollout_id!r}")
    keep: dict[str, dict[str, Any]] = {}
    for span in hits:
        for related in [span, *index.ancestors(span), *index.descendants(span)]:
            keep[related["span_id"]] = related
    lines = []
    roots = sorted((s for s in keep.values() if index.is_root(s)), key=lambda s: s.get("start_ns") or 0)
    for root in roots:
        lines.append(f"trace {root['trace_id']}")
        lines.extend(render_tree(index, root, keep=set(keep)))
    linking = {s["span_id"]: s for sid in keep for s in index.linked_from.get(sid, [])}
    if linking:
        lines.append("linked from:")
        lines.extend(describe(s) for s in sorted(linking.values(), key=lambda s: s.get("start_ns") or 0))
    return lines


def overview(spans: Sequence[dict[str, Any]], limit: int, max_children: int = 4) -> list[str]:
    """The per-name summary, then the newest ``limit`` traces (by root start) with few children per span."""
    rows = summary(spans)
    width = max(len(r["name"]) for r in rows)
    lines = [f"{len(spans)} spans in {len({s['trace_id'] for s in spans})} traces",
             f"{'span':<{width}}  {'count':>7}  {'p50 ms':>9}  {'p95 ms':>9}"]
    lines.extend(f"{r['name']:<{width}}  {r['count']:>7}  {r['p50_ms']:>9.2f}  {r['p95_ms']:>9.2f}" for r in rows)
    index = SpanIndex(spans)
    for root in index.roots()[-limit:] if limit > 0 else []:
        lines.append("")
        lines.append(f"trace {root['trace_id']}")
        lines.extend(render_tree(index, root, max_children=max_children))
    return lines
