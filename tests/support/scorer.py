"""Scorer test helpers: the tiny Llama config of the reference model, the scorer role run on a thread
(``ScorerThread``), and senders of rollouts keyed by group."""

from __future__ import annotations

import threading

from transformers import LlamaConfig

from consumers.scorer.builtin_rewards import exact_match
from consumers.scorer.config import ScorerConfig
from consumers.scorer.scorer import ScorerDeps, run_scorer
from schemas import Rollout
from stream_rl.transport.client import Transport
from stream_rl.transport.tracing import Tracing
from support.messages import rollout_for_scoring

VOCAB = 32




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
            self.stats = run_scorer(cfg, scorer_cfg, self.stop, deps=ScorerDeps(tracing=tracing))
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
    return [rollout_for_scoring(i, s, response_text="7" if s % 2 == 0 else "8", **kwargs)
            for i in range(first, first + groups) for s in range(4)]


def trace_id(headers) -> str:
    return dict(headers)["traceparent"].decode().split("-")[1]


def poisonable_reward(prompt, response, answer, metadata):
    """Test reward: NaN or an exception when the metadata asks for it, else exact match."""
    if metadata.get("poison") == "nan":
        return float("nan")
    if metadata.get("poison") == "raise":
        raise ZeroDivisionError("poisoned")
    if metadata.get("poison") == "dense":
        return {"reward": 1.0, "token_rewards": [0.25] * int(metadata["length"])}
    return exact_match(prompt, response, answer, metadata)
