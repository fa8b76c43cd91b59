"""Test helpers moved from test_scorer.py."""

from __future__ import annotations

import threading

import numpy as np
from transformers import LlamaConfig

from consumers.scorer.config import ScorerConfig
from consumers.scorer.scorer import ScorerDeps, run_scorer
from schemas import Rollout, group_id_for, rollout_id_for
from stream_rl.transport.client import Transport
from stream_rl.transport.tracing import Tracing

VOCAB = 32


def make_rollout(i: int, sample: int = 0, *, prompt_ids=(1, 5, 6), response_ids=(7, 8, 2), temperature=1.0,
                 response_text="7", answer="7", metadata=None, prompt_text="3+4=") -> Rollout:
    n = len(response_ids)
    return Rollout(
        rollout_id=rollout_id_for(f"q{i}", 0, sample), prompt_id=f"q{i}", epoch=0, group_id=group_id_for(f"q{i}", 0),
        sample_index=sample, group_size=4, prompt_token_ids=np.array(prompt_ids, dtype=np.int32),
        response_token_ids=np.array(response_ids, dtype=np.int32),
        behavior_logprobs=np.full(n, -0.5, dtype=np.float32), token_policy_versions=np.zeros(n, dtype=np.int64),
        finish_reason="stop", producer_id="producer-0", prompt_text=prompt_text, response_text=response_text,
        answer=answer, metadata=dict(metadata or {}), temperature=temperature)


def llama_config(**extra) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2, head_dim=32, intermediate_size=128, max_position_embeddings=32,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **extra)


class ScorerThread:
    """run_scorer in a thread, stopped through its stop event."""

    def __init__(self, cfg, scorer_cfg: ScorerConfig, tracing: Tracing | None = None):
        self.stop, self.stats, self.error = threading.Event(), None, None
        self.thread = threading.Thread(target=self._run, args=(cfg, scorer_cfg, tracing), daemon=True)
        self.thread.start()

    def _run(self, cfg, scorer_cfg, tracing):
        try:
            self.stats = run_scorer(cfg.model_copy(update={"scorer": scorer_cfg}), self.stop,
                                    deps=ScorerDeps(tracing=tracing))
        except BaseException as exc:  # handed to the test thread by finish()
            self.error = exc

    def finish(self):
        self.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "scorer did not stop"
        if self.error is not None:
            raise self.error
        return self.stats


def send_rollouts(t: Transport, rollouts, partition=None) -> list:
    sink = t.sink()
    for r in rollouts:
        sink.send(t.names.rollouts, r, key=r.group_id, partition=partition)
    acks = sink.flush()
    sink.close()
    return acks


def group_rollouts(first: int, groups: int, **kwargs) -> list[Rollout]:
    return [make_rollout(i, s, response_text="7" if s % 2 == 0 else "8", **kwargs)
            for i in range(first, first + groups) for s in range(4)]


def trace_id(headers) -> str:
    return dict(headers)["traceparent"].decode().split("-")[1]
