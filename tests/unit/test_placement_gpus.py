"""The CUDA_VISIBLE_DEVICES each role process of `stream-rl run` gets from run.gpus, seen by real child processes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import typer

from stream_rl.cli.config import load_config
from stream_rl.cli.run_cmd import _gpu_devices
from stream_rl.launch.orchestrator import role_env

PRINT_DEVICES = "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>'))"
NODE = {"run.gpus.count": 8, "run.gpus.producers": "0-5", "run.gpus.trainer": "6-7", "run.gpus.scorers": "6",
        "run.producers": 3, "run.scorers": 1, "run.trainer_ranks": 2, "producer.engine": "vllm",
        "producer.vllm.tensor_parallel_size": 2, "producer.vllm.gpu_memory_utilization": 0.5}


def _child_sees(env: dict[str, str]) -> str:
    """What a real child process started with ``env`` reads as its CUDA_VISIBLE_DEVICES."""
    return subprocess.run([sys.executable, "-c", PRINT_DEVICES], env=env, capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()


def test_each_role_process_sees_its_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    devices = _gpu_devices(load_config(None, env={}, overrides=NODE))
    assert devices == {"produce-0": "0,1", "produce-1": "2,3", "produce-2": "4,5", "score-0": "6",
                       "train-0": "6,7"}
    import os

    seen = {process: _child_sees(role_env(os.environ, 1, gpus)) for process, gpus in devices.items()}
    assert seen == devices


def test_layout_indexes_into_the_callers_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "8,9,10,11,12,13,14,15")
    devices = _gpu_devices(load_config(None, env={}, overrides=NODE))
    assert devices["train-0"] == "14,15" and devices["produce-1"] == "10,11"


def test_no_layout_leaves_the_environment_alone():
    import os

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "3"}
    assert _gpu_devices(load_config(None, env={})) == {}
    assert _child_sees(role_env(env, 1, None)) == "3"


def test_an_empty_list_hides_every_gpu():
    import os

    assert _child_sees(role_env(os.environ, 1, "")) == ""


def test_unknown_count_is_checked_against_torch_at_launch(capsys):
    # run.gpus.count unset: torch's count decides; no machine here has 4096 GPUs
    cfg = load_config(None, env={}, overrides={"run.gpus.scorers": "4095"})
    with pytest.raises(typer.Exit) as exit_:
        _gpu_devices(cfg)
    assert exit_.value.exit_code == 2
    assert "run.gpus.scorers: GPU 4095 does not exist: torch says" in capsys.readouterr().err


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.mark.skipif(_gpu_count() < 1, reason="needs a CUDA GPU: torch sees none on this machine")
def test_a_role_on_gpu_0_sees_exactly_one_gpu():
    import os

    code = "import torch; print(torch.cuda.device_count())"
    done = subprocess.run([sys.executable, "-c", code], env=role_env(os.environ, 1, visible_devices_of("0")),
                          capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.strip() == "1"


def visible_devices_of(devices: str) -> str:
    """The CUDA_VISIBLE_DEVICES `stream-rl run` gives a process listed with ``devices`` under this environment."""
    import os

    from stream_rl.launch.gpus import parse_devices, visible_devices

    return visible_devices(parse_devices(devices), os.environ.get("CUDA_VISIBLE_DEVICES"))
