"""Data-parallel trainer ranks on CPU (gloo): N ranks computing the one-rank step, `stream-rl run` with two ranks,
and two "machines" forming one trainer. The lockstep plan and the launcher's messages:
tests/unit/test_trainer_rank_plan.py.

The 2-rank runs go through torch's own launcher (``python -m torch.distributed.run``), as users run them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.paths import REPO_ROOT


ROOT = REPO_ROOT


def _two_rank_run(out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests" / "support" / "dist_step_worker.py"), str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


# Measured (2 CPU cores, gloo), weights after 2 steps x 2 epochs x 2 minibatches at lr 1e-2, against the same engine
# on one rank: torch 0.0 (the summed gradients are bit-identical); ZeRO-2 max 1.6e-5 on one development machine and
# 1.16e-4 on another (same packages, another CPU), ZeRO-3 max 1.0e-4 and 8.7e-5. ZeRO reduce-scatters in another
# order, and Adam's first updates magnify rounding-level differences of near-zero gradients (as in
# test_trainer_deepspeed) into a few lr-sized ones, so the largest difference depends on the CPU's rounding; the
# bulk does not: on the second machine the median difference was 8e-8 and 0.09 % of the elements differed by more
# than 1e-5. The updates themselves move weights by ~1e-2, and a lost or doubled gradient moves them by that much.
TOLERANCE = {"torch": 1e-6, "zero2": 5e-4, "zero3": 5e-4}  # the largest difference, 5 % of one update
BULK_TOLERANCE = 1e-6  # the median difference
OUTLIER_FRACTION = 0.01  # elements differing by more than 1e-5


def _assert_resumable_on_one_rank(root: Path, weights: dict) -> None:
    """The 2-rank checkpoint is consolidated: it loads into a plain one-rank torch engine, weights exactly, with the
    full AdamW state of every parameter (a different N resumes from it)."""
    from support.dist_step_worker import step_config
    from support.trainer import tiny_policy

    from consumers.trainer.engines import TorchEngine, TrainModule
    from stream_rl.storage.checkpoint import latest_checkpoint

    engine = TorchEngine(TrainModule(tiny_policy(seed=5)), step_config())
    engine.load(latest_checkpoint(root))
    loaded = engine.state_dict()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)
    tensors, meta = engine.optimizer_state()
    names = {n for n, _ in engine.module.named_parameters()}
    assert {k.rsplit("::", 1)[0] for k in tensors} == names and meta["scalars"]


@pytest.mark.slow
def test_two_ranks_compute_the_one_rank_steps_for_torch_zero2_and_zero3(tmp_path):
    """Same batches, same seed: the 2-rank weights equal the 1-rank ones (TOLERANCE), and each engine's 2-rank
    checkpoint resumes on 1 rank."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (optional extra 'deepspeed')")
    from safetensors.torch import load_file
    from support.dist_step_worker import ENGINES, run_steps
    from support.trainer import tiny_policy

    from consumers.trainer.ranks import SOLO

    _two_rank_run(tmp_path)
    torch.set_num_threads(1)
    initial = {f"policy.{k}": v for k, v in tiny_policy(seed=0).state_dict().items()}
    for name in ENGINES:
        weights, metrics = run_steps(name, SOLO)
        assert max(float((weights[k] - initial[k]).abs().max()) for k in initial) > 1e-3  # the steps did train
        for rank in (0, 1):
            ranked = load_file(str(tmp_path / f"{name}-rank{rank}.safetensors"))
            assert ranked.keys() == weights.keys()
            diffs = torch.cat([(weights[k] - ranked[k]).abs().flatten() for k in weights])
            assert float(diffs.max()) <= TOLERANCE[name], (name, rank, float(diffs.max()))
            assert float(diffs.median()) <= BULK_TOLERANCE, (name, rank, float(diffs.median()))
            assert float((diffs > 1e-5).float().mean()) <= OUTLIER_FRACTION, (name, rank)
            ranked_metrics = json.loads((tmp_path / f"{name}-rank{rank}.json").read_text())
            _assert_resumable_on_one_rank(tmp_path / f"{name}-ckpt", ranked)
            for one, two in zip(metrics, ranked_metrics, strict=True):
                assert one.keys() == two.keys()
                assert two["optim/updates"] == 4.0 and two["batch/sequences"] == 6.0
                for key in ("loss/total", "loss/kl", "optim/grad_norm", "kl/ref_mean", "policy/entropy"):
                    assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), (name, key)


@pytest.mark.slow
@pytest.mark.broker
@pytest.mark.timeout(600)
def test_run_with_two_trainer_ranks_trains_and_stops_cleanly(broker, tmp_path, run_name):
    """`stream-rl run` with run.trainer_ranks=2: the trainer child is the launcher of 2 gloo ranks; the run
    reaches its step budget and every rank exits 0 (the followers on the leader's STOP)."""
    from support.harness import role_overrides, tiny_policy_dir

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_id": f"p{i}", "text": f"{i}+{i}=", "answer": str(2 * i)}) + "\n"
                               for i in range(8)))
    overrides = role_overrides(tiny_policy_dir(tmp_path / "policy"), **{
        "run.demo_dir": None, "run.prompts_file": str(prompts), "run.group_size": 4, "run.trainer_ranks": 2,
        "run_dir": str(tmp_path / "run"), "trainer.checkpoint_every": 2, "trainer.collective_timeout_s": 60})
    sets = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={'null' if value is None else value}")]
    cmd = [sys.executable, "-m", "stream_rl.cli.main", "run", "--bootstrap", broker.bootstrap, "--run", run_name,
           "--max-steps", "3", *sets]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=540, cwd=tmp_path,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log = (tmp_path / "run" / "logs" / "train-0.log").read_text()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:] + log[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "rank 0 of 2" in log and "rank 1 of 2" in log
    assert "rank 1: stop after 3 steps" in log  # the follower trained every step and stopped on the leader's word


@pytest.mark.slow
@pytest.mark.broker
@pytest.mark.timeout(600)
def test_two_machines_each_running_train_nnodes_2_form_one_trainer(make_config, tmp_path):
    """The multi-node command, on one machine: two launchers (`train --nproc 1 --nnodes 2 --rdzv-endpoint ...`)
    meet at the rendezvous and train as global ranks 0 and 1; only the leader consumes."""
    from support.harness import Pipeline, demo_prompts, role_overrides, tiny_policy_dir

    from stream_rl.broker import free_port

    cfg = make_config(**role_overrides(tiny_policy_dir(tmp_path / "policy"), **{
        "trainer.max_steps": 2, "trainer.checkpoint_every": 2, "trainer.collective_timeout_s": 60}))
    endpoint = f"127.0.0.1:{free_port()}"
    node = ("--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", endpoint)
    with Pipeline(cfg) as pipe:
        pipe.load(demo_prompts(tmp_path, 8, 1, 4))
        machines = [pipe.start("train", i, *node) for i in range(2)]
        pipe.start("score", 0)
        pipe.start("produce", 0)
        pipe.wait_until(lambda: all(pipe.finished(m) for m in machines), "both trainer machines to finish", 400,
                        may_exit=machines)
        logs = [m.log.read_text() for m in machines]
        assert [line["step"] for line in pipe.trained()] == [1, 2]
    joined = "\n".join(logs)
    assert "rank 0 of 2" in joined and "rank 1 of 2" in joined
    assert "rank 1: stop after 2 steps" in joined
