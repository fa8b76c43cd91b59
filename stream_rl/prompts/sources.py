"""Prompt-file formats: JSON lines, Parquet and ``datasets`` directories, read record by record with their numbers.

Consumes: a path whose suffix names the format (``.jsonl``/``.json``/``.ndjson``: JSON lines; ``.parquet``/
``.pq``: Parquet, read with pyarrow), or a directory written by ``datasets.Dataset.save_to_disk`` (format ``hf``,
read with ``datasets.load_from_disk``, imported only then: a missing package is one error naming the extra), or a
named source instead of a path: ``reasoning-gym:NAME?size=N&seed=S`` (format ``reasoning-gym``, a reasoning-gym
dataset generated in memory, :mod:`stream_rl.hubs.rgym`) or ``verifiers:TASKSET?size=N`` (format ``verifiers``,
a verifiers taskset's tasks, :mod:`stream_rl.hubs.vf`); each imports its hub only then.
Produces: ``(number, record)`` pairs in file order, where ``number`` is the 1-based physical line (JSON lines;
blank lines are skipped but still counted) or the 1-based row (Parquet, ``hf``), and ``record`` is the decoded object or
a :class:`~stream_rl.prompts.schema.Problem` when the line cannot be decoded (number 0: the whole file).
Guarantees: reading streams (a JSON-lines file is never held in memory whole; Parquet is read in batches); a
line that is not UTF-8, not JSON, or repeats a key is a problem of that line and reading goes on; Parquet
nested columns arrive as Python values (``struct`` -> dict, ``list<struct>`` -> list of dicts, a top-level ``map``
-> dict), and the ``struct`` or ``map`` values of ``metadata`` become plain dicts (a struct's null members are
dropped, since a struct column carries every key seen in any row). :func:`columns` gives the file's top-level
columns (the schema's names; for JSON lines every key of every object, in first-seen order).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from stream_rl import hubs
from stream_rl.prompts.schema import Problem, PromptFileError

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
"""File suffix -> format; a ``.json`` file must hold JSON lines (one object per line), not one array."""
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
"""Files of a ``save_to_disk`` directory (a ``DatasetDict`` has ``dataset_dict.json`` and one folder per split)."""
DATASETS_EXTRA = "pip install 'stream-rl[data]' (or pip install datasets)"

Record = tuple[int, object]

_PARQUET_BATCH_ROWS = 4096


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def file_format(path: Path) -> str:
    """``"jsonl"`` or ``"parquet"`` from the suffix (``"hf"``: a datasets directory, ``"reasoning-gym"``: a named
    source); :class:`PromptFileError` for a missing file or other suffix."""
    kind = hubs.source_kind(path)
    if kind is not None:
        _named(kind, lambda hub: hub.parse_spec(path))
        return kind
    path = Path(path)
    if path.is_dir():
        if any((path / marker).is_file() for marker in HF_MARKERS):
            return "hf"
        raise PromptFileError(f"{path}: a directory that is not a Hugging Face datasets directory (no "
                              f"{', '.join(HF_MARKERS)}; write one with Dataset.save_to_disk)")
    if not path.is_file():
        raise PromptFileError(f"prompt file not found: {path}")
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise PromptFileError(f"{path}: unknown prompt file format {path.suffix!r} "
                              f"(expected one of {', '.join(sorted(FORMATS))})")
    return fmt


def iter_records(path: Path, fmt: str) -> Iterator[Record]:
    """Every record of the file with its line (JSON lines) or row (Parquet) number, in order."""
    if fmt == "hf":
        return _hf_records(Path(path))
    if fmt in hubs.SOURCES:
        return _named(fmt, lambda hub: hub.records(path))
    return _jsonl_records(Path(path)) if fmt == "jsonl" else _parquet_records(Path(path))


def columns(path: Path, fmt: str) -> list[str]:
    """The file's top-level columns; JSON lines: every key of every object record, in first-seen order."""
    if fmt == "hf":
        return list(load_hf(Path(path)).column_names)
    if fmt in hubs.SOURCES:
        return ["prompt_id", "text", "messages", "answer", "metadata"]
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return list(pq.ParquetFile(path).schema_arrow.names)
        except (pa.ArrowException, OSError):
            return []  # reading reports it, on line 0
    seen: dict[str, None] = {}
    for _, record in _jsonl_records(Path(path)):
        if isinstance(record, dict):
            seen.update(dict.fromkeys(map(str, record)))
    return list(seen)


def load_hf(path: Path):
    """The ``datasets.Dataset`` saved in ``path``; :class:`PromptFileError` without ``datasets``, for a dict of
    splits (naming them), or for a directory it cannot read."""
    try:
        import datasets
    except ImportError:
        raise PromptFileError(f"{path}: reading a Hugging Face datasets directory needs the datasets package: "
                              f"{DATASETS_EXTRA}") from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as exc:
        raise PromptFileError(f"{path}: not a readable datasets directory: {type(exc).__name__}: "
                              f"{str(exc)[:200]}") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = ", ".join(str(path / name) for name in loaded)
        raise PromptFileError(f"{path}: holds several splits; pass one of: {splits}")
    return loaded


def _named(kind: str, call):
    """``call(hub)``, with a named source's errors (a bad spec, its hub not installed) as PromptFileError."""
    hub = hubs.source_module(kind)
    try:
        out = call(hub)
        return iter(list(out)) if isinstance(out, Iterator) else out
    except (hub.SpecError, hubs.HubMissing) as exc:
        raise PromptFileError(str(exc)) from None


def _hf_records(path: Path) -> Iterator[Record]:
    for row, record in enumerate(load_hf(path), start=1):
        yield row, record


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _decode_line(raw: bytes, lineno: int) -> object:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Problem(lineno, None, f"not UTF-8 (byte {exc.start + 1})")
    if not line.strip():
        return None
    try:
        return json.loads(line, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        return Problem(lineno, exc.key, "appears twice in the object")
    except json.JSONDecodeError as exc:
        hint = " (a JSON array is not supported: write one object per line)" if line.lstrip().startswith("[") \
            and lineno == 1 else ""
        return Problem(lineno, None, f"not JSON: {exc.msg} at column {exc.colno}{hint}")


def _jsonl_records(path: Path) -> Iterator[Record]:
    with path.open("rb") as handle:
        for lineno, raw in enumerate(handle, start=1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # UTF-8 byte order mark
            record = _decode_line(raw, lineno)
            if record is not None:
                yield lineno, record


def _parquet_records(path: Path) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        metadata_type = next((f.type for f in parquet.schema_arrow if f.name == "metadata"), None)
        maps = [f.name for f in parquet.schema_arrow if pa.types.is_map(f.type) and f.name != "metadata"]
        row = 0
        for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
            for record in batch.to_pylist():
                row += 1
                if metadata_type is not None and record.get("metadata") is not None:
                    record["metadata"] = _plain_metadata(record["metadata"], metadata_type)
                for name in maps:  # a map value arrives as a list of (key, value) pairs
                    record[name] = None if record[name] is None else dict(record[name])
                yield row, record
    except (pa.ArrowException, OSError) as exc:
        yield 0, Problem(0, None, f"not a readable Parquet file: {type(exc).__name__}: {str(exc)[:200]}")


def _plain_metadata(value: object, arrow_type) -> object:
    import pyarrow as pa

    if pa.types.is_map(arrow_type):
        return dict(value)  # a map value arrives as a list of (key, value) pairs
    if pa.types.is_struct(arrow_type):
        return {key: item for key, item in value.items() if item is not None}
    return value
