"""One rank of the data-parallel step test (no tests here): run under torchrun by tests/integration/test_trainer_ranks.py.

``python -m torch.distributed.run --nproc-per-node N tests/dist_step_worker.py OUT`` trains the same two steps
with the torch engine and with ZeRO-2 and ZeRO-3 on N gloo ranks, and writes, per engine and rank,
``OUT/{engine}-rank{r}.safetensors`` (the consolidated weights after the steps) and ``OUT/{engine}-rank{r}.json``
(each step's metrics), and rank 0 a checkpoint in ``OUT/{engine}-ckpt``. The test computes the one-rank reference in
its own process with :func:`run_steps`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

ENGINES = {"torch": {"engine": "torch"}, "zero2": {"engine": "deepspeed", "zero_stage": 2},
           "zero3": {"engine": "deepspeed", "zero_stage": 3}}


def step_config(**overrides):
    """6 rollouts, 2 minibatches of 3 rows, micro batches of 1, 2 epochs: on 2 ranks each minibatch splits 2/1,
    so rank 1 runs a ghost micro batch; a KL term and clipping exercise the whole loss."""
    from support.trainer import trainer_cfg

    base = dict(micro_batch_size=1, minibatches=2, epochs=2, grad_clip=0.5, lr=1e-2, weight_decay=0.01,
                kl={"coef": 0.1})
    return trainer_cfg(**{**base, **overrides})


def step_batches():
    from consumers.trainer.tensors import build_batch
    from support.trainer import random_group, tiny_policy

    model, ref = tiny_policy(seed=0), tiny_policy(seed=9)
    out = []
    for seed in (0, 1):
        rng = np.random.default_rng(seed)
        out.append(build_batch([s for p in range(3) for s in random_group(model, p, group_size=2, rng=rng,
                                                                          ref_model=ref)]))
    return out


def run_steps(name: str, ranks, checkpoint: Path | None = None) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    """Two steps of engine ``name`` on ``ranks``: (consolidated weights, per-step metrics); with ``checkpoint``,
    the leader also writes a checkpoint there (every rank joins the gathers, as a follower's SAVE does)."""
    from consumers.trainer.engines import TrainModule, build_engine
    from consumers.trainer.train_step import TrainState, train_step
    from support.trainer import tiny_policy

    cfg = step_config(**ENGINES[name])
    engine = build_engine(TrainModule(tiny_policy(seed=0)), cfg, ranks)
    state = TrainState(kl_coef=cfg.kl.coef)
    metrics = [train_step(engine, batch, cfg, state) for batch in step_batches()]
    if checkpoint is not None and ranks.leader:
        from stream_rl.storage.checkpoint import save_checkpoint

        save_checkpoint(checkpoint, step=2, version=2, engine=engine, offsets={}, ledger={}, state=state.to_json())
    elif checkpoint is not None:
        engine.full_state()
    return engine.state_dict(), metrics


def main(out: Path) -> None:
    from safetensors.torch import save_file

    from consumers.trainer.ranks import Ranks

    torch.set_num_threads(1)
    ranks = Ranks.from_env(timeout_s=120.0, use_cuda=False)
    for name in sys.argv[2:] or ENGINES:
        weights, metrics = run_steps(name, ranks, checkpoint=out / f"{name}-ckpt")
        save_file(weights, str(out / f"{name}-rank{ranks.rank}.safetensors"))
        (out / f"{name}-rank{ranks.rank}.json").write_text(json.dumps(metrics))
    ranks.close()
    # Every result is on disk. Seen once in three fresh-clone runs: the interpreter's teardown after the DeepSpeed
    # engines aborted a rank ("terminate called without an active exception", exit -6) although its results were
    # written; leave without running the C++ destructors, so the test judges the results, not the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]  # repo, tests
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]))
