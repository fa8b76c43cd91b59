"""One rank of the trainer-ranks benchmark (:mod:`bench.ranks`), started by torch's launcher.

``python -m torch.distributed.run --standalone --nproc-per-node N -m bench.ranks_worker POLICY_DIR OUT.json ROWS
STEPS`` trains the trainer's own step (:func:`consumers.trainer.train_step.train_step` on the torch engine over
:class:`consumers.trainer.ranks.Ranks`: what ``stream-rl train --nproc N`` runs, without the Kafka side that only
the leader has) on one batch shaped like the demo's (ROWS rollouts, prompts of 7 tokens, 6 response tokens), two
warm-up steps and then STEPS timed ones; then times the gradient all-reduce alone (one flat fp32 buffer of every
parameter, as the engine sends it). Rank 0 writes ``{"step_s": [...], "allreduce_s": [...], "tokens": n,
"grad_bytes": n, "world": N, "threads": t}``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch


def demo_batch(vocab: int, rows: int, seed: int = 0):
    """``rows`` scored rollouts of random tokens (prompt 7, response 6, groups of 8, rewards 0/1)."""
    from consumers.trainer.tensors import build_batch
    from schemas import Rollout, ScoredRollout, group_id_for, rollout_id_for

    rng = np.random.default_rng(seed)
    out = []
    for i in range(rows):
        pid, sample = f"p{i // 8}", i % 8
        rollout = Rollout(
            rollout_id=rollout_id_for(pid, 0, sample), prompt_id=pid, epoch=0, group_id=group_id_for(pid, 0),
            sample_index=sample, group_size=8, prompt_token_ids=rng.integers(3, vocab, 7).astype(np.int32),
            response_token_ids=rng.integers(3, vocab, 6).astype(np.int32),
            behavior_logprobs=np.full(6, -2.0, dtype=np.float32), token_policy_versions=np.zeros(6, dtype=np.int64),
            finish_reason="stop", producer_id="bench", prompt_text="", response_text="", temperature=1.0)
        out.append(ScoredRollout(rollout=rollout, reward=float(rng.integers(0, 2)), scorer_id="bench"))
    return build_batch(out)


def main(policy_dir: Path, out: Path, rows: int, steps: int) -> None:
    from consumers.trainer.config import TrainerConfig
    from consumers.trainer.engines import TrainModule, build_engine
    from consumers.trainer.ranks import Ranks
    from consumers.trainer.train_step import TrainState, train_step
    from stream_rl.models import load_policy

    ranks = Ranks.from_env(timeout_s=300.0, use_cuda=False)
    policy, _ = load_policy(policy_dir)
    cfg = TrainerConfig(groups_per_step=rows // 8, micro_batch_size=256, lr=1e-4, device="cpu")
    engine = build_engine(TrainModule(policy), cfg, ranks)
    batch, state = demo_batch(policy.config.vocab_size, rows), TrainState()
    times = []
    for i in range(2 + steps):
        t0 = time.perf_counter()
        train_step(engine, batch, cfg, state)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    params = list(engine.module.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    reduce_s = []
    for _ in range(steps):
        t0 = time.perf_counter()
        ranks.all_reduce_grads(params)
        reduce_s.append(time.perf_counter() - t0)
    if ranks.leader:
        out.write_text(json.dumps({"step_s": times, "allreduce_s": reduce_s, "tokens": batch.n_tokens,
                                   "grad_bytes": sum(p.numel() * 4 for p in params), "world": ranks.world,
                                   "threads": torch.get_num_threads()}))
    ranks.close(together=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
