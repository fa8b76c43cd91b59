"""run.gpus: device lists, per-process assignment, the rules refused at config time, and the planner's proposal.

Every expected value is worked out by hand in the comment beside it.
"""

from __future__ import annotations

import pytest

from stream_rl.cli.config import gpu_counts, load_config
from stream_rl.config.base import ConfigError
from stream_rl.launch.gpus import GpuLayout, RoleCounts, assign, describe, layout_errors, parse_devices, visible_devices
from stream_rl.planner import PlanInputs, make_plan
from stream_rl.planner.layout import layout_toml, propose_layout, share


def test_parse_devices_ranges_lists_and_none():
    assert parse_devices("0-2,5") == (0, 1, 2, 5)
    assert parse_devices(" 6 ") == (6,)
    assert parse_devices("") == ()
    assert parse_devices("none") == ()


@pytest.mark.parametrize("text, words", [("0-x", "'0-x' is not a GPU index"), ("3-1", "runs backwards"),
                                         ("0,1,1", "GPU 1 is listed twice")])
def test_parse_devices_refuses_bad_text(text, words):
    with pytest.raises(ValueError, match=words):
        parse_devices(text)


def test_node_layout_assigns_blocks_per_producer():
    layout = GpuLayout(count=8, producers="0-5", trainer="6-7", scorers="6")
    counts = RoleCounts(producers=3, scorers=2, trainer_ranks=2, evaluator=False, tensor_parallel_size=2)
    # 6 producer GPUs in blocks of 2: (0,1), (2,3), (4,5), one per producer
    assert assign(layout, counts) == {"produce-0": (0, 1), "produce-1": (2, 3), "produce-2": (4, 5),
                                      "score-0": (6,), "score-1": (6,), "train-0": (6, 7)}
    assert layout_errors(layout, counts) == []


def test_more_producers_than_blocks_go_round_robin():
    layout = GpuLayout(producers="0-1")
    counts = RoleCounts(producers=3, scorers=1, trainer_ranks=1, evaluator=False)
    table = assign(layout, counts)
    assert [table[f"produce-{i}"] for i in range(3)] == [(0,), (1,), (0,)]
    assert "train-0" not in table  # no trainer list: its environment is left as it is


def test_visible_devices_index_into_the_parents_list():
    assert visible_devices((0, 2), None) == "0,2"
    assert visible_devices((1,), "2,3") == "3"
    assert visible_devices((), None) == ""


def _fields(errors):
    return [fields for fields, _ in errors]


def test_an_index_past_the_count_is_refused():
    errors = layout_errors(GpuLayout(count=4, scorers="4"), RoleCounts(1, 1, 1, False))
    assert _fields(errors) == [("run.gpus.scorers", "run.gpus.count")]
    assert "GPU 4 does not exist: run.gpus.count says 4 GPU(s), indexes 0-3" in errors[0][1]
    # at launch the count torch reports replaces run.gpus.count
    errors = layout_errors(GpuLayout(trainer="0"), RoleCounts(1, 1, 1, False), count=0)
    assert "GPU 0 does not exist: torch says 0 GPU(s)" in errors[0][1]


def test_tensor_parallel_larger_than_the_producers_gpus_is_refused():
    errors = layout_errors(GpuLayout(producers="0"), RoleCounts(1, 1, 1, False, tensor_parallel_size=2))
    assert _fields(errors) == [("producer.vllm.tensor_parallel_size", "run.gpus.producers")]


def test_more_trainer_ranks_than_gpus_is_refused():
    errors = layout_errors(GpuLayout(trainer="6"), RoleCounts(1, 1, 2, False))
    assert _fields(errors) == [("run.trainer_ranks", "run.gpus.trainer")]


def test_shares_on_one_gpu_with_headroom():
    counts = RoleCounts(1, 1, 1, False, producer_share=0.4)
    # 0.4 + 0.3 + 0.1 = 0.8; x 1.2 = 0.96 <= 1: fits
    fits = GpuLayout(producers="0", trainer="0", scorers="0", trainer_memory=0.3, scorer_memory=0.1)
    assert layout_errors(fits, counts) == []
    assert describe(fits, counts)[-1] == "  GPU 0: memory share 0.8 (0.96 with headroom)"
    # 0.4 + 0.35 + 0.1 = 0.85; x 1.2 = 1.02 > 1: refused, naming every share on the GPU and the headroom
    over = fits.model_copy(update={"trainer_memory": 0.35})
    errors = layout_errors(over, counts)
    assert _fields(errors) == [("producer.vllm.gpu_memory_utilization", "run.gpus.scorer_memory",
                                "run.gpus.trainer_memory", "run.gpus.headroom")]
    assert "= 0.85 of the GPU, 1.02 with run.gpus.headroom=0.2" in errors[0][1]


def test_two_scorers_on_a_gpu_count_twice():
    counts = RoleCounts(producers=1, scorers=2, trainer_ranks=1, evaluator=False, producer_share=0.0)
    # 2 x 0.4 = 0.8; x 1.2 = 0.96: fits; 2 x 0.45 = 0.9; x 1.2 = 1.08: refused
    assert layout_errors(GpuLayout(scorers="1", scorer_memory=0.4), counts) == []
    assert len(layout_errors(GpuLayout(scorers="1", scorer_memory=0.45), counts)) == 1


GPU_SETS = {"run.gpus.count": 1, "run.gpus.producers": "0", "run.gpus.trainer": "0", "run.gpus.scorers": 0,
            "run.gpus.trainer_memory": 0.3, "run.gpus.scorer_memory": 0.05, "producer.engine": "vllm",
            "producer.vllm.gpu_memory_utilization": 0.4}


def test_config_load_accepts_a_smoke_layout():
    cfg = load_config(None, env={}, overrides=GPU_SETS)
    assert cfg.run.gpus.scorers == "0"  # a bare number is one index


@pytest.mark.parametrize("extra, fields", [
    ({"run.gpus.producers": "1"}, ["run.gpus.producers", "run.gpus.count"]),
    ({"producer.vllm.gpu_memory_utilization": 0.6}, ["producer.vllm.gpu_memory_utilization",
                                                     "run.gpus.trainer_memory"]),
    ({"producer.vllm.tensor_parallel_size": 2}, ["producer.vllm.tensor_parallel_size"]),
    ({"run.trainer_ranks": 2}, ["run.trainer_ranks", "run.gpus.trainer"]),
    ({"producer.vllm.engine_kwargs": {"seed": 3}}, ["producer.vllm.engine_kwargs"]),
])
def test_config_load_refuses_bad_layouts_naming_fields(extra, fields):
    with pytest.raises(ConfigError) as err:
        load_config(None, env={}, overrides={**GPU_SETS, **extra})
    for field in fields:
        assert field in str(err.value)


def test_share_rounds_up_to_hundredths():
    gib = 2**30
    assert share(0, 80 * gib) == 0.0
    assert share(8 * gib, 80 * gib) == 0.1  # exactly a tenth
    assert share(8 * gib + 1, 80 * gib) == 0.11  # a byte more rounds up
    assert share(1, 80 * gib) == 0.01


def test_plan_proposes_the_one_gpu_smoke_layout_with_exact_shares():
    # 5e8 parameters, bf16 with fp32 master weights and AdamW, 1 x 24 GiB, no architecture (weights only):
    # trainer: fp32 weights 4P + autocast bf16 copy 2P + fp32 grads 4P + adam 8P = 18P = 9.0e9 B = 8.38 GiB -> 0.35
    # generator: bf16 weights 2P = 1e9 B = 0.931 GiB -> 0.04; scorer: bf16 reference 2P -> 0.04
    plan = make_plan(PlanInputs(params=500_000_000, gpu_memory_gib=24))
    layout = propose_layout(plan)
    assert plan.recommendation == "colocated"
    assert layout["run"]["gpus"] == {"count": 1, "producers": "0", "trainer": "0", "scorers": "0",
                                     "trainer_memory": 0.35, "scorer_memory": 0.04, "headroom": 0.2}
    assert layout["producer"]["vllm"] == {"tensor_parallel_size": 1, "gpu_memory_utilization": 0.04}
    assert "[run.gpus]" in layout_toml(layout) and 'trainer = "0"' in layout_toml(layout)
    # the proposal passes the run's own check: 0.35 + 0.04 + 0.04 = 0.43, x 1.2 = 0.516
    counts = RoleCounts(1, 1, 1, False, producer_share=0.04)
    assert layout_errors(GpuLayout(**layout["run"]["gpus"]), counts) == []


def test_plan_proposes_separate_gpus_on_a_node():
    # 3e9 bf16 at ZeRO 3 over 8 x 80 GiB, trainer ranks 2: the trainer on 0-1, the scorer on 2, producers 3-7
    plan = make_plan(PlanInputs(params=3_000_000_000, zero_stage=3, gpus=8, trainer_ranks=2))
    layout = propose_layout(plan)
    assert plan.recommendation == "separate"
    gpus = layout["run"]["gpus"]
    assert (gpus["trainer"], gpus["scorers"], gpus["producers"]) == ("0-1", "2", "3-7")
    assert (layout["run"]["producers"], layout["run"]["trainer_ranks"]) == (5, 2)
    # generator: bf16 weights 2 x 3e9 = 6e9 B = 5.588 GiB of 80 -> 0.0698 -> 0.07; the scorer's reference too
    assert layout["producer"]["vllm"]["gpu_memory_utilization"] == 0.07
    assert gpus["scorer_memory"] == 0.07


def test_empty_lists_hide_every_gpu_and_are_not_refused():
    layout = GpuLayout(producers="", trainer="none", scorers="")
    counts = RoleCounts(producers=2, scorers=1, trainer_ranks=2, evaluator=False, tensor_parallel_size=2)
    assert layout_errors(layout, counts) == []  # CPU roles: no block, no GPU per rank needed
    assert assign(layout, counts) == {"produce-0": (), "produce-1": (), "score-0": (), "train-0": ()}


def test_plan_command_prints_the_layout():
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "stream_rl.cli.main", "plan", "--params", "5e8", "--gpu-memory-gib", "24"]
    table = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120).stdout
    assert "[run.gpus]\n  count = 1\n  producers = \"0\"\n  trainer = \"0\"" in table
    assert "trainer_memory = 0.35" in table and "gpu_memory_utilization = 0.04" in table
    as_json = json.loads(subprocess.run(cmd + ["--json"], capture_output=True, text=True, check=True,
                                        timeout=120).stdout)
    assert as_json["layout"]["run"]["gpus"]["trainer_memory"] == 0.35


def _dotted(node: dict, prefix: str = "") -> dict:
    """A proposed layout as ``--set`` overrides (``run.gpus.count`` = 8, ...)."""
    out: dict = {}
    for key, value in node.items():
        out.update(_dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def test_plan_proposes_inference_servers_on_the_gpus_left_and_the_run_accepts_it():
    # 3e9 bf16 at ZeRO 3 over 8 x 80 GiB, trainer ranks 2, --servers 4: trainer 0-1, scorer 2, servers 3, 4, 5, 6
    plan = make_plan(PlanInputs(params=3_000_000_000, zero_stage=3, gpus=8, trainer_ranks=2, servers=4))
    assert plan.recommendation == "separate" and plan.colocated.reason.startswith("--servers 4")
    assert plan.separate.gpus == 7  # 2 + 4 + 1: one GPU spare
    layout = propose_layout(plan)
    assert layout["producer"] == {"engine": "server"}
    # a server has its GPU alone: all but the 20 % headroom, floor(100 / 1.2) / 100 = 0.83
    assert layout["run"]["servers"] == {"count": 4, "gpus": ["3", "4", "5", "6"],
                                        "extra_args": ["--gpu-memory-utilization", "0.83"]}
    assert (layout["run"]["producers"], layout["run"]["gpus"]["producers"]) == (4, "")
    assert '[run.servers]' in layout_toml(layout) and 'gpus = ["3", "4", "5", "6"]' in layout_toml(layout)
    cfg = load_config(None, env={}, overrides=_dotted(layout))  # the run's own checks accept it
    assert cfg.run.servers.devices() == ((3,), (4,), (5,), (6,))
    # 0.83 x 1.2 = 0.996 <= 1 on each server's GPU
    assert "  GPU 3: memory share 0.83 (0.996 with headroom)" in describe(cfg.run.gpus, gpu_counts(cfg))


def test_a_server_on_a_trainer_gpu_or_past_the_count_is_refused_naming_run_servers_gpus():
    layout = propose_layout(make_plan(PlanInputs(params=3_000_000_000, zero_stage=3, gpus=8, trainer_ranks=2,
                                                 servers=2)))
    sets = _dotted(layout)
    # a server at 0.83 beside a trainer rank at 0.42: 1.25 of GPU 0
    with pytest.raises(ConfigError) as err:
        load_config(None, env={}, overrides={**sets, "run.servers.gpus": ["0", "4"]})
    assert "run.servers.gpus" in str(err.value) and "run.gpus.trainer_memory" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, env={}, overrides={**sets, "run.servers.gpus": ["3", "8"]})
    assert "run.servers.gpus: GPU 8 does not exist: run.gpus.count says 8 GPU(s)" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, env={}, overrides={**sets, "run.servers.gpus": ["3"]})
    assert "run.servers.gpus has 1 entries for run.servers.count=2" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, env={}, overrides={**sets, "run.servers.extra_args": ["--gpu-memory-utilization=1.5"]})
    assert "--gpu-memory-utilization '1.5'" in str(err.value)


def test_server_memory_share_comes_from_its_arguments_or_vllms_default():
    from stream_rl.launch.servers import VLLM_MEMORY_DEFAULT, memory_share

    assert memory_share(["--max-num-seqs", "8", "--gpu-memory-utilization", "0.5"]) == 0.5
    assert memory_share(["--gpu-memory-utilization=0.25"]) == 0.25
    assert memory_share([]) == VLLM_MEMORY_DEFAULT == 0.9
    for bad in (["--gpu-memory-utilization"], ["--gpu-memory-utilization", "x"], ["--gpu-memory-utilization=0"]):
        with pytest.raises(ValueError, match="a share of the GPU in"):
            memory_share(bad)
    # two servers at vLLM's default on one GPU: 1.8 of it
    counts = RoleCounts(1, 1, 1, False, servers=((0,), (0,)), server_share=0.9)
    assert _fields(layout_errors(GpuLayout(count=1), counts)) == [("run.servers.gpus", "run.gpus.headroom")]


def test_plan_servers_need_their_gpus():
    plan = make_plan(PlanInputs(params=3_000_000_000, zero_stage=3, gpus=4, trainer_ranks=2, servers=2))
    assert plan.recommendation == "does-not-fit" and "need 5 GPU(s)" in plan.message
    assert propose_layout(plan) is None


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_gpu_pipeline_server_mode_is_a_layout_the_run_accepts(device, tmp_path):
    # bench/gpu_pipeline.py --engine server: one server on GPU 0 at its vLLM share beside the trainer and scorer
    # (a CPU machine: no GPU anywhere). Ran end to end on CPU by hand: docs/benchmarks.md (GPU pipeline check).
    from bench.gpu_pipeline import VLLM_SHARE, overrides

    sets = overrides(tmp_path, tmp_path / "model", tmp_path / "p.jsonl", device, "tiny", 3, engine="server")
    cfg = load_config(None, env={}, overrides=sets)
    counts = gpu_counts(cfg)
    assert (cfg.producer.engine, cfg.run.servers.count, cfg.run.gpus.producers) == ("server", 1, "")
    if device == "cuda":
        assert counts.servers == ((0,),) and counts.server_share == VLLM_SHARE == 0.3
        assert f"  GPU 0: memory share {VLLM_SHARE:g}" in "\n".join(describe(cfg.run.gpus, counts))
    else:
        assert counts.servers == () and cfg.run.servers.extra_args == []
