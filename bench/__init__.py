"""The stream-rl benchmark suite: the pipeline measured against its own limits, side by side in one run.

Entry points: ``python -m bench.run [NAMES...] [--quick]`` and ``make bench``. Each run starts
its own local broker (or uses ``--bootstrap``), measures the benchmarks asked for, merges their results into a JSON
file of raw numbers (``bench/results.json``) and regenerates ``docs/benchmarks.md`` from that file. The code
writes tables and numbers only; each benchmark's reading (what the figures mean) is prose written by hand in
``docs/benchmarks.md`` between ``<!-- reading: NAME, ... -->`` markers, kept by every regeneration
(:func:`bench.common.kept_reading`; a module that still defines ``reading(result)``, pipeline and TRL, fills its
own in code). bench/ is a folder of the checkout, not part of the installed wheel: run it from
the repository root.

Method (binding for every benchmark): a figure is a ratio of two things measured in the same run, each repeated
(variants interleaved round by round, median of at least 3); absolute times only describe the run they come from
and are never compared across runs; tests check that figures exist and are finite, never how fast anything is.

A benchmark is a module with (see :mod:`bench.transport` for an example):

- ``run(ctx: bench.common.BenchContext) -> dict`` returning ``{"figures": {name: float}, "samples": {name:
  [float, ...]}, "params": {...}, "notes": [str, ...]}``; every figure must be finite and positive;
- ``table(result) -> (headers, rows)``: the Markdown table of its figures;
- ``headline(result) -> str``: one line for the summary table;
- optionally ``more_tables(result) -> str``: further Markdown tables of figures and derived numbers (goals met or
  not, floors, settings), rendered under the table;

and one :class:`bench.common.BenchSpec` entry in :data:`bench.run.BENCHMARKS`.
"""
