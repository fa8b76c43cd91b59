"""Benchmark 4, weight broadcast: from the trainer starting ``publish`` of version v+1 to a producer holding the
verified tensors, inline and store modes, against safetensors save + load of the same tensors to local disk.

What one measurement of a mode times, in one process, nothing overlapped::

    t0 ─ WeightsPublisher.publish(state, v+1) ─ WeightsReceiver.poll_latest(newer_than=v) ─ .fetch(manifest) ─ t1
         serialize, SHA-256, chunks to Kafka     sees the manifest                          every chunk read (or
         (inline) or save_file + SHA-256 +                                                 the file mapped),
         fsync (store), manifest acked                                                     digests and index
                                                                                            checked

and the baseline times ``safetensors.torch.save_file`` + ``load_file`` of the same state dict to the same disk
(no fsync, no digests, no broker); after it, outside its window, one fsync of its file and one SHA-256 pass over
the file through a memory map are timed too, the physical costs a verified, durable store broadcast adds. A
producer polls the weights topic between generation batches, so in a real run its notice delay adds to this;
loading the tensors into the engine (``load_state_dict``) is not included.

Synthetic state dicts: float32 tensors of at most 4 MiB each (a 1 GB dict has 239 of them). Sizes: 10 MB, 100 MB
and 1 GB (``--quick``: 1 MB and 10 MB). Inline mode keeps every chunk in the broker's RAM (tansu's memory
store); it runs up to :data:`INLINE_MAX_BYTES`, which covers 1 GB because a 1 GB inline round took about 30 s on
the 2-core development machine (about 4 GB peak in this process, 1 GB in the broker). A size whose rough peak
memory exceeds 70% of the available RAM is skipped with a note. Each measurement's chunk topics and files are
garbage-collected before the next one (deleting a chunk topic frees the broker's memory). Every version here moves
the full state dict: delta versions (``weights.snapshot_every``) are measured in bench/deltas.py.

LoRA (``trainer.lora``): :func:`lora_sizes` counts the bytes one broadcast moves with adapters only against the full
model, for Qwen2.5-0.5B's shape built on the ``meta`` device (no memory): the adapter state dict is the one the
trainer publishes (peft's trainable tensors under their wire names, in the producers' dtype), and a payload is
exactly the sum of its tensors' bytes (``payload_size``). ``python -m bench.weights`` prints just that table.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.common import MB, BenchContext, fmt, interleave, md_table, medians, mem_available_bytes, rss_bytes

TITLE = "Weight broadcast"
TENSOR_BYTES = 4 << 20
INLINE_MAX_BYTES = 1000 * MB
"""Largest payload broadcast inline (the memory-store broker holds the whole version in RAM until it is deleted)."""
PEAK_MEMORY_FACTOR = {"inline": 6, "store": 4}
"""Rough peak RSS of one broadcast in copies of the payload (state, file bytes, chunks, received, decoded...)."""
FETCH_TIMEOUT_S = 600.0
LORA_RANKS = (8, 16, 64)
LORA_TARGETS = {"attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
                "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
"""The default trainer.lora.target_modules (attention) and every linear layer of a decoder block."""


def sizes_for(ctx: BenchContext) -> tuple[int, ...]:
    return ctx.pick(full=(10 * MB, 100 * MB, 1000 * MB), quick=(1 * MB, 10 * MB), tiny=(MB // 4,))


def label(size: int) -> str:
    return f"{size / 1000 / MB:g}GB" if size >= 1000 * MB else f"{size / MB:g}MB"


def synthetic_state(total_bytes: int, seed: int = 0) -> dict[str, Any]:
    """Float32 tensors (``(rows, 1024)``, at most :data:`TENSOR_BYTES` each) adding up to ``total_bytes``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    state, left, index = {}, total_bytes - total_bytes % 4, 0
    while left > 0:
        nbytes = min(left, TENSOR_BYTES)
        numel = nbytes // 4
        shape = (numel // 1024, 1024) if numel % 1024 == 0 else (numel,)
        state[f"model.layers.{index}.weight"] = torch.randn(shape, generator=gen)
        left -= nbytes
        index += 1
    return state


class _Broadcast:
    """One trainer-side publisher per mode and one producer-side receiver, on one run's topics and store."""

    def __init__(self, ctx: BenchContext):
        from stream_rl.transport.client import Transport
        from stream_rl.weights import WeightsConfig, WeightsPublisher, WeightsReceiver

        self.cfg = ctx.config("bench-weights")
        self.transport = Transport(self.cfg, "bench-weights")
        self.sink = self.transport.sink()
        self.publishers = {mode: WeightsPublisher(self.transport, self.sink, WeightsConfig(
            mode=mode, fetch_timeout_s=FETCH_TIMEOUT_S), trainer_id="bench-trainer") for mode in ("inline", "store")}
        self.receiver = WeightsReceiver(self.transport, WeightsConfig(fetch_timeout_s=FETCH_TIMEOUT_S))
        self.disk_dir = Path(self.cfg.run_dir) / "disk"
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        self.version = 0
        self.broker_pid = ctx.broker_pid

    def step(self, mode: str, size: int, state: Mapping[str, Any]):
        def measure() -> dict[str, float]:
            self.version += 1
            t0 = time.perf_counter()
            self.publishers[mode].publish(state, version=self.version, step=self.version)
            t1 = time.perf_counter()
            manifest = self.receiver.poll_latest(timeout_s=60.0, newer_than=self.version - 1)
            if manifest is None or manifest.version != self.version:
                raise RuntimeError(f"weights v{self.version} was published but the receiver saw {manifest}")
            tensors = self.receiver.fetch(manifest)
            t2 = time.perf_counter()
            _check_same(tensors, state)
            del tensors
            key = label(size)
            out = {f"{key}.{mode}_s": t2 - t0, f"{key}.{mode}_publish_s": t1 - t0, f"{key}.{mode}_fetch_s": t2 - t1}
            broker_rss = rss_bytes(self.broker_pid)
            if broker_rss is not None and mode == "inline":  # holding this version, before garbage collection
                out[f"{key}.inline_broker_rss_mb"] = broker_rss / MB
            self.publishers[mode].collect_garbage(keep_last=1)
            return out
        return measure

    def disk_step(self, size: int, state: Mapping[str, Any]):
        def measure() -> dict[str, float]:
            from safetensors.torch import load_file, save_file

            path = self.disk_dir / "state.safetensors"
            t0 = time.perf_counter()
            save_file(dict(state), str(path))
            t1 = time.perf_counter()
            loaded = load_file(str(path))
            t2 = time.perf_counter()
            _check_same(loaded, state)
            del loaded
            key = label(size)
            out = {f"{key}.disk_s": t2 - t0, f"{key}.disk_save_s": t1 - t0, f"{key}.disk_load_s": t2 - t1,
                   **_physical_costs(path, key)}
            path.unlink()
            return out
        return measure

    def close(self) -> None:
        self.publishers["inline"].collect_garbage(keep_last=1)
        self.receiver.close()
        self.sink.close()
        self.transport.tracing.shutdown()


def _physical_costs(path: Path, key: str) -> dict[str, float]:
    """Outside the baseline's window, on its file: one fsync of it, and one SHA-256 pass over its bytes through
    a memory map (what a store broadcast adds per side for its digest), so the reading can say what bounds it."""
    import hashlib
    import mmap
    import os

    with open(path, "rb") as handle:
        t0 = time.perf_counter()
        os.fsync(handle.fileno())
        t1 = time.perf_counter()
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            hashlib.sha256(mapped).hexdigest()
        t2 = time.perf_counter()
    return {f"{key}.fsync_s": t1 - t0, f"{key}.sha256_pass_s": t2 - t1}


def _check_same(got: Mapping[str, Any], want: Mapping[str, Any]) -> None:
    if set(got) != set(want) or any(got[name].shape != want[name].shape for name in want):
        raise RuntimeError("the fetched state dict differs from the published one")


def _modes_for(size: int, notes: list[str]) -> tuple[str, ...]:
    modes = ("inline", "store") if size <= INLINE_MAX_BYTES else ("store",)
    available = mem_available_bytes()
    need = max(PEAK_MEMORY_FACTOR[m] for m in modes) * size
    if available is not None and need > 0.7 * available:
        notes.append(f"{label(size)} skipped: it needs about {need / 1e9:.1f} GB of RAM, "
                     f"{available / 1e9:.1f} GB were available")
        return ()
    return modes


def lora_sizes(dtype: str = "bfloat16") -> dict[str, float]:
    """Bytes per broadcast of the full Qwen2.5-0.5B-shaped policy and of its LoRA adapters at each rank and target
    set (``lora.{targets}.r{rank}.bytes`` / ``.fraction``), in ``dtype``; counted on the meta device."""
    import torch

    from bench.deltas import QWEN_SHAPE, qwen_model
    from consumers.trainer.config import LoraConfig
    from consumers.trainer.engines import cast_floating
    from consumers.trainer.lora import adapter_state, wrap_policy
    from stream_rl.models import tie_groups
    from stream_rl.weights.payload import payload_size

    model = qwen_model(QWEN_SHAPE, "meta")
    state = model.state_dict()
    full = payload_size(cast_floating({g[0]: state[g[0]] for g in tie_groups(model)}, dtype))
    figures = {"lora.full_bytes": float(full)}
    for targets, modules in LORA_TARGETS.items():
        for rank in LORA_RANKS:
            with torch.device("meta"):
                peft_model = wrap_policy(qwen_model(QWEN_SHAPE, "meta"), LoraConfig(
                    enabled=True, rank=rank, alpha=2.0 * rank, target_modules=list(modules)))
            trainable = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
            size = payload_size(cast_floating(adapter_state(trainable), dtype))
            figures[f"lora.{targets}.r{rank}.bytes"] = float(size)
            figures[f"lora.{targets}.r{rank}.fraction"] = size / full
    return figures


def lora_table(figures: Mapping[str, float]) -> str:
    """The LoRA figures as a Markdown table (bytes per broadcast)."""
    full = figures["lora.full_bytes"]
    rows = ["| what one version carries (Qwen2.5-0.5B shape, bf16) | bytes | MB | of the full model |",
            "|---|---|---|---|", f"| full model | {full:.0f} | {full / MB:.1f} | 100% |"]
    for targets in LORA_TARGETS:
        for rank in LORA_RANKS:
            size = figures[f"lora.{targets}.r{rank}.bytes"]
            rows.append(f"| LoRA r={rank} on {', '.join(LORA_TARGETS[targets])} | {size:.0f} | {size / MB:.2f} | "
                        f"{100 * size / full:.2f}% |")
    return "\n".join(rows)


def run(ctx: BenchContext) -> dict[str, Any]:
    """Every size: baseline, inline and store, interleaved round by round; figures are medians and ratios."""
    broadcast, samples, notes, measured = _Broadcast(ctx), {}, [], []
    try:
        for size in sizes_for(ctx):
            modes = _modes_for(size, notes)
            if not modes:
                continue
            ctx.log(f"weights: {label(size)} ({', '.join(('disk',) + modes)})")
            state = synthetic_state(size)
            steps = [("disk", broadcast.disk_step(size, state))]
            steps += [(mode, broadcast.step(mode, size, state)) for mode in modes]
            samples.update(interleave(steps, ctx.repeats, ctx.log))
            measured.append((size, modes))
            del state, steps
    finally:
        broadcast.close()
    figures = {**_figures(medians(samples), measured), **lora_sizes()}
    notes += [f"Inline ran at {label(size)} too, uncapped: a round took {figures[f'{label(size)}.inline_s']:.0f} s "
              f"(median), within the few-minute budget set for inline rounds above 100 MB."
              for size, modes in measured if size > 100 * MB and "inline" in modes]
    return {"figures": figures, "samples": samples, "notes": notes,
            "params": {"sizes_bytes": [s for s, _ in measured], "modes": {label(s): list(m) for s, m in measured},
                       "tensor_bytes": TENSOR_BYTES, "dtype": "float32", "inline_max_bytes": INLINE_MAX_BYTES,
                       "chunk_size": broadcast.publishers["inline"].cfg.chunk_size,
                       "max_request_size": broadcast.cfg.kafka.max_request_size, "repeats": ctx.repeats}}


def _figures(med: Mapping[str, float], measured: list[tuple[int, tuple[str, ...]]]) -> dict[str, float]:
    figures = dict(med)
    for size, modes in measured:
        key = label(size)
        for mode in modes:
            figures[f"{key}.{mode}_vs_disk"] = med[f"{key}.{mode}_s"] / med[f"{key}.disk_s"]
            figures[f"{key}.{mode}_mb_s"] = size / MB / med[f"{key}.{mode}_s"]
        figures[f"{key}.disk_mb_s"] = size / MB / med[f"{key}.disk_s"]
    return figures


def _sizes(result: Mapping[str, Any]) -> list[str]:
    return [label(s) for s in result["params"]["sizes_bytes"]]


def _cell(figures: Mapping[str, float], key: str, mode: str) -> tuple[str, str]:
    if f"{key}.{mode}_s" not in figures:
        return f"not run (inline capped at {INLINE_MAX_BYTES / MB:g} MB)", "–"
    parts = f"{fmt(figures[f'{key}.{mode}_publish_s'])} + {fmt(figures[f'{key}.{mode}_fetch_s'])}"
    return f"{fmt(figures[f'{key}.{mode}_s'])} ({parts})", f"**{fmt(figures[f'{key}.{mode}_vs_disk'])}×**"


def table(result: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    figures = result["figures"]
    headers = ["state dict", "safetensors save + load, s", "inline, s (publish + fetch)", "inline ÷ disk",
               "store, s (publish + fetch)", "store ÷ disk", "MB/s disk / inline / store",
               "broker RSS holding it inline, MB"]
    rows = []
    for key in _sizes(result):
        inline, inline_ratio = _cell(figures, key, "inline")
        store, store_ratio = _cell(figures, key, "store")
        disk = f"{fmt(figures[f'{key}.disk_s'])} ({fmt(figures[f'{key}.disk_save_s'])} + " \
               f"{fmt(figures[f'{key}.disk_load_s'])})"
        rates = " / ".join(fmt(figures.get(f"{key}.{m}_mb_s")) for m in ("disk", "inline", "store"))
        rows.append([key, disk, inline, inline_ratio, store, store_ratio, rates,
                     fmt(figures.get(f"{key}.inline_broker_rss_mb"))])
    return headers, rows


def headline(result: Mapping[str, Any]) -> str:
    figures, sizes = result["figures"], _sizes(result)
    if not sizes:
        return "nothing measured"
    big = sizes[-1]
    text = f"{big} store: {fmt(figures[f'{big}.store_vs_disk'])}× safetensors save + load"
    if f"{big}.inline_vs_disk" in figures:
        text += f"; inline {fmt(figures[f'{big}.inline_vs_disk'])}×"
    return text


def _floor(figures: Mapping[str, float], key: str) -> float:
    """Seconds a store broadcast cannot go below: the baseline's save, one fsync, one digest pass per side."""
    return figures[f"{key}.disk_save_s"] + figures[f"{key}.fsync_s"] + 2 * figures[f"{key}.sha256_pass_s"]



INLINE_GOAL = ("100MB", 4.0)
"""Issue 14's goal for inline mode: at most 4x the disk round trip at 100 MB."""


def more_tables(result: Mapping[str, Any]) -> str:
    """What a verified, durable store broadcast cannot go below, per size, against the store and inline times;
    the inline goal; the LoRA adapters' share of a full broadcast."""
    figures, sizes = result["figures"], _sizes(result)
    if not sizes:
        return "Nothing was measured (see the notes)."
    rows = []
    for key in sizes:
        floor = _floor(figures, key)
        inline = (f"{fmt(figures[f'{key}.inline_s'] / figures[f'{key}.store_s'])}×" if f"{key}.inline_s" in figures
                  else "–")
        rows.append([key, fmt(figures[f"{key}.sha256_pass_s"]), fmt(figures[f"{key}.fsync_s"]), fmt(floor),
                     f"{fmt(floor / figures[f'{key}.disk_s'])}×", f"{fmt(figures[f'{key}.store_s'] / floor)}×",
                     inline])
    text = md_table(["state dict", "one SHA-256 pass, s", "fsync, s", "floor: save + fsync + 2 passes, s",
                     "floor ÷ disk", "store ÷ floor", "inline ÷ store"], rows)
    size, goal = INLINE_GOAL
    if f"{size}.inline_vs_disk" in figures:
        ratio = figures[f"{size}.inline_vs_disk"]
        text += (f"\n\nInline goal (issue 14): at most {goal:g}× the disk round trip at {size}; this run "
                 f"{fmt(ratio)}×: {'met' if ratio <= goal else 'not met'}.")
    if "lora.full_bytes" in figures:
        text += "\n\n" + md_table(["LoRA broadcast, Qwen2.5-0.5B shape, bf16", "MB", "of the full model"], [
            ["full model", f"{figures['lora.full_bytes'] / MB:.0f}", "100 %"],
            ["rank 8 on q/k/v/o (the default targets)", f"{figures['lora.attn.r8.bytes'] / MB:.2f}",
             f"{100 * figures['lora.attn.r8.fraction']:.2f} %"],
            ["rank 64 on every linear layer", f"{figures['lora.all.r64.bytes'] / MB:.1f}",
             f"{100 * figures['lora.all.r64.fraction']:.2f} %"]])
    return text

if __name__ == "__main__":
    print(lora_table(lora_sizes()))
