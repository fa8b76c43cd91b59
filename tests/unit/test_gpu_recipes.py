"""The GPU recipes (configs/gpu-smoke.toml, configs/gpu-node.toml) through `stream-rl run --dry-run`: the layout
each role process gets and the per-GPU shares, and a recipe pushed past its GPU refused naming the fields."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _dry_run(config: str, *sets: str) -> subprocess.CompletedProcess:
    args = [a for s in sets for a in ("--set", s)]
    return subprocess.run([sys.executable, "-m", "stream_rl.cli.main", "run", "-c", str(ROOT / "configs" / config),
                           "--dry-run", *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_smoke_recipe_puts_every_role_on_gpu_0():
    done = _dry_run("gpu-smoke.toml")
    assert done.returncode == 0, done.stderr
    cfg = json.loads(done.stdout)  # stdout stays the config's JSON
    assert cfg["producer"]["vllm"]["engine_kwargs"] == {"max_num_seqs": 256}
    # 0.20 (vLLM) + 0.02 (scorer) + 0.45 (trainer) = 0.67; x 1.2 = 0.804
    assert done.stderr.strip().splitlines()[-5:] == [
        "gpus (1 GPU(s)):", "  produce-0: CUDA_VISIBLE_DEVICES=0", "  score-0: CUDA_VISIBLE_DEVICES=0",
        "  train-0: CUDA_VISIBLE_DEVICES=0", "  GPU 0: memory share 0.67 (0.804 with headroom)"]


def test_node_recipe_gives_each_producer_a_tensor_parallel_block():
    done = _dry_run("gpu-node.toml")
    assert done.returncode == 0, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[lines.index("gpus (8 GPU(s)):") + 1:][:5] == [
        "  produce-0: CUDA_VISIBLE_DEVICES=0,1", "  produce-1: CUDA_VISIBLE_DEVICES=2,3",
        "  produce-2: CUDA_VISIBLE_DEVICES=4,5", "  score-0: CUDA_VISIBLE_DEVICES=6",
        "  train-0: CUDA_VISIBLE_DEVICES=6,7"]
    # GPU 6: trainer rank 0 (0.48) + the scorer (0.04) = 0.52, x 1.2 = 0.624; GPU 7: rank 1 alone, 0.48 -> 0.576
    assert "  GPU 6: memory share 0.52 (0.624 with headroom)" in lines
    assert "  GPU 7: memory share 0.48 (0.576 with headroom)" in lines


def test_smoke_recipe_with_too_much_vllm_memory_is_refused():
    done = _dry_run("gpu-smoke.toml", "producer.vllm.gpu_memory_utilization=0.5")
    assert done.returncode == 2
    # 0.5 + 0.02 + 0.45 = 0.97 of the GPU, 1.16 with the headroom
    assert "GPU 0: producer.vllm.gpu_memory_utilization=0.5 + run.gpus.scorer_memory=0.02 + " \
           "run.gpus.trainer_memory=0.45 = 0.97 of the GPU, 1.16 with run.gpus.headroom=0.2" in done.stderr


def test_node_recipe_with_a_gpu_that_does_not_exist_is_refused():
    done = _dry_run("gpu-node.toml", "run.gpus.trainer=7-8")
    assert done.returncode == 2
    assert "run.gpus.trainer: GPU 8 does not exist: run.gpus.count says 8 GPU(s), indexes 0-7" in done.stderr


def test_node_recipe_with_tensor_parallel_larger_than_the_block_is_refused():
    done = _dry_run("gpu-node.toml", "producer.vllm.tensor_parallel_size=4")
    assert done.returncode == 2
    assert "producer.vllm.tensor_parallel_size=4 does not divide the 6 GPU(s) of run.gpus.producers" in done.stderr
