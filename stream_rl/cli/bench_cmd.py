"""``stream-rl bench``: the benchmark suite (``bench/``, results in ``docs/benchmarks.md``) from the command line.

Consumes: benchmark names and the options of ``python -m bench.run``. Produces: what ``bench.run.main`` produces
(the merged JSON results and the regenerated Markdown report); with ``--dry-run`` only the arguments it would
get, as JSON (bench takes no stream-rl config). The ``bench`` package is imported only when the
command runs, so the rest of the CLI never pays for it and works where it is not installed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from stream_rl.cli.common import BootstrapOpt, fail


def bench(
    names: Annotated[list[str] | None, typer.Argument(
        help="benchmarks to run: transport, pipeline, async, weights, offpolicy, scorers, ranks, deltas; "
             "default all")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="small sizes; writes bench/results.quick.json and no "
                                        "Markdown unless --out is given")] = False,
    out: Annotated[Path | None, typer.Option("--out", help="Markdown report to regenerate (default: "
                                             "docs/benchmarks.md of the repository)")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="raw results file to merge into (default: "
                                                   "bench/results.json of the repository)")] = None,
    repeats: Annotated[int, typer.Option(help="rounds per figure; the median is reported (>= 3)")] = 3,
    bootstrap: BootstrapOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the arguments `python -m bench.run` would get "
                                          "and exit")] = False,
) -> None:
    """Run benchmarks and regenerate docs/benchmarks.md (same as `python -m bench.run`; see that file).

    Needs the `bench` package of the repository: it is installed with the project (`make install`, editable);
    from a stale install, run `python -m bench.run` from the repository root instead.
    """
    argv = list(names or [])
    argv += ["--quick"] if quick else []
    argv += ["--out", str(out)] if out is not None else []
    argv += ["--json", str(json_path)] if json_path is not None else []
    argv += ["--repeats", str(repeats)]
    argv += ["--bootstrap", bootstrap] if bootstrap else []
    if dry_run:
        typer.echo(json.dumps({"bench.run": argv}))
        raise typer.Exit(0)
    try:
        from bench.run import main as bench_main
    except ImportError as exc:
        fail(f"the bench package is not importable ({exc}): reinstall the project with `make install`, or run "
             "`python -m bench.run` from the repository root", 2)
    code = bench_main(argv)
    if code:
        raise typer.Exit(code)
