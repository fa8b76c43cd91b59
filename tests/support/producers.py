"""Producer test helpers: tiny model directories, prompt records, a scripted engine (``FakeEngine``),
the producer role run on a thread (``start_producer``/``stop_producer``) and readers of what it wrote, and the
in-flight-update analysis (``swap_errors``) shared by the hf and vLLM engine tests."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from producers.engines.base import GenerationEngine, Sample
from schemas import Prompt
from support.topics import read_records


def tiny_llama_config(tokenizer, max_positions: int = 64):
    """The tests' tiny LlamaForCausalLM shape for the demo char tokenizer: hidden 64, 2 layers, 2 heads of dim 32
    (rotary positions: ``max_positions`` changes no weight)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, intermediate_size=128, max_position_embeddings=max_positions,
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)


def build_tiny_model_dir(path: Path, seed: int = 0, max_positions: int = 64) -> Path:
    """A tiny LlamaForCausalLM (:func:`tiny_llama_config`) + the demo char tokenizer, saved."""
    from transformers import LlamaForCausalLM

    from stream_rl.demo.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(tokenizer, max_positions))
    with torch.no_grad():  # a sharper output head than the default init, so samples are far from uniform
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def perturbed_state_dict(model_dir: Path, scale: float = 0.5, seed: int = 1) -> dict[str, torch.Tensor]:
    """The model's weights plus Gaussian noise: a different, valid policy version."""
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(str(model_dir / "model.safetensors"))
    return {name: t + scale * torch.randn(t.shape, generator=gen) * t.std().clamp_min(1e-3)
            for name, t in tensors.items()}


def recompute_logprobs(model, prompts: list[list[int]], groups: list[list[Sample]], temperature: float,
                       pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Trainer-style recomputation: one full forward over left-padded prompt+response rows, position ids
    ``cumsum(mask) - 1``, ``log softmax(logits / T)`` at each response token. Returns (recomputed, engine)
    logprobs, flattened over every response token."""
    from stream_rl.algorithms import logprobs_from_logits

    rows = [(p, s) for p, group in zip(prompts, groups, strict=True) for s in group]
    width = max(len(p) + len(s.token_ids) for p, s in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (p, s) in enumerate(rows):
        seq = p + s.token_ids
        ids[r, width - len(seq):] = torch.tensor(seq)
        mask[r, width - len(seq):] = 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # (B, T)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()  # (B, T, V)
    logp = logprobs_from_logits(logits[:, :-1] / temperature, ids[:, 1:])  # (B, T-1): token t+1 given <= t
    recomputed, engine = [], []
    for r, (_, s) in enumerate(rows):
        length = len(s.token_ids)
        recomputed.append(logp[r, width - 1 - length:].numpy())
        engine.append(np.asarray(s.logprobs, dtype=np.float32))
    return np.concatenate(recomputed), np.concatenate(engine)


def reference_model(model_dir: Path, state_dict: dict[str, torch.Tensor] | None = None):
    """The policy loaded independently of any engine (as the trainer would), optionally with other weights."""
    from stream_rl.models.loading import load_policy, load_state_dict_strict

    model, _ = load_policy(model_dir)
    model.eval()
    if state_dict is not None:
        load_state_dict_strict(model, state_dict)
    return model


PROMPTS = [[1, 4, 13, 5, 14], [1, 9, 9, 13, 3, 12, 14], [1, 14]]  # "1+2=", "66+09=", "=": different lengths


class FakeEngine(GenerationEngine):
    """Sample j of a prompt = [10 + j, eos] with logprobs [-0.5, -0.25]; records the calls it gets."""

    def __init__(self, tokenizer, version: int = 4):
        self._tokenizer, self._version, self.calls = tokenizer, version, []

    version = property(lambda self: self._version)
    eos_token_id = property(lambda self: 2)
    tokenizer = property(lambda self: self._tokenizer)
    max_model_len = property(lambda self: 16)
    vocab_size = property(lambda self: 15)

    def generate(self, prompt_token_ids, n, sampling, max_new_tokens, seed):
        self.calls.append((prompt_token_ids, n, sampling, max_new_tokens, seed))
        return [[Sample([10 + j, 2], [-0.5, -0.25], "stop") for j in range(n)] for _ in prompt_token_ids]

    def load_weights(self, state_dict, version):
        raise NotImplementedError


def prompt_record(i: int, epoch: int = 0, group_size: int = 3, text: str | None = None, attempt: int = 0) -> Prompt:
    return Prompt(prompt_id=f"p{i}", epoch=epoch, text=text or f"{i}+1=", answer=str(i + 1), group_size=group_size,
                  metadata={"task": "add"}, attempt=attempt, created_at=1000.0)


def resume_hf_cuts(engine: GenerationEngine, model_dir: Path, budget: int = 12) -> list[tuple]:
    """Groups cut by the hf engine (6 prompts x 3 samples, ``oversample`` 1.0, stop ids 3-7 so rows end at very
    different steps, ``budget`` new tokens) resumed on ``engine``: one ``(prefix, rollout, errors)`` per sample,
    ``errors`` the |hf logprob - behaviour logprob| of a cut sample's continuation (None for a sample that ended
    before the cut). The resumption tests of each engine assert on these."""
    from producers.engines.base import Sampling
    from producers.engines.hf import HFEngine, score_tokens
    from producers.step import EarlyStop, produce_rollouts
    from producers.partials import prefixes, resume_partials

    sampling = Sampling(1.0, stop_token_ids=(3, 4, 5, 6, 7))
    hf = HFEngine.from_dir(model_dir)
    kw = {"producer_id": "p0", "sampling": sampling, "max_new_tokens": budget, "seed": 3}
    cut = produce_rollouts([prompt_record(i, group_size=3) for i in range(6)], hf,
                           early_stop=EarlyStop(oversample=1.0, keep_partials=True), **kw)
    assert cut.partials
    by_id = {r.rollout_id: r for r in resume_partials(cut.partials, engine, max_lag=0, **kw).rollouts}
    out = []
    for partial in cut.partials:
        for i, (prefix, was_cut) in enumerate(prefixes(partial)):
            rollout, length = by_id[f"{partial.group_id}:{i}"], len(prefix.token_ids)
            errors = None
            if was_cut:
                tokens = rollout.response_token_ids.tolist()
                want = score_tokens(hf.model, partial.prompt_token_ids.tolist() + prefix.token_ids,
                                    tokens[length:], sampling)
                errors = np.abs(np.asarray(want) - rollout.behavior_logprobs[length:]).tolist()
            out.append((prefix, rollout, errors))
    return out


def collect(transport, topic: str, want: int, timeout_s: float = 40.0) -> list:
    """Every record of ``topic`` (decoded rollouts) once at least ``want`` are there, or at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = read_records(transport, topic, "rollout")
        if len(got) >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def start_producer(cfg, pcfg, engine, weights_cfg=None):
    """run_producer in a thread on ``cfg`` with ``pcfg`` (and ``weights_cfg``) as its sections, reusing ``engine``."""
    from producers.role import ProducerDeps, ProducerStats, run_producer

    stop, stats, out = threading.Event(), ProducerStats(), {}
    cfg = cfg.model_copy(update={"producer": pcfg, **({"weights": weights_cfg} if weights_cfg is not None else {})})

    def target():
        try:
            out["stats"] = run_producer(cfg, cfg.producer, stop, deps=ProducerDeps(engine=engine, stats=stats))
        except BaseException as exc:  # surfaced by the test after join
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, stop, stats, out


def stop_producer(thread, stop, out):
    stop.set()
    thread.join(60)
    assert not thread.is_alive()
    if "error" in out:
        raise out["error"]
    return out["stats"]


def send_prompts(transport, prompts: list[Prompt]) -> None:
    sink = transport.sink()
    for p in prompts:
        sink.send(transport.names.prompts, p, key=p.prompt_id)
    sink.flush()
    sink.close()


TEMPERATURE = 0.7


@torch.no_grad()
def _logp(logits: torch.Tensor, targets: list[int]) -> np.ndarray:
    """log softmax(logits / T) at ``targets``: logits [1, L, V], targets [L]."""
    logp = torch.log_softmax(logits[0].float() / TEMPERATURE, dim=-1)  # [L, V]
    return logp[torch.arange(len(targets)), torch.tensor(targets)].numpy()


@torch.no_grad()
def _what_the_engine_conditions_on(old, new, prompt: list[int], tokens: list[int], k: int) -> np.ndarray:
    """Logprobs of tokens ``k..`` as the engine computes them after a swap before token k: the old weights' cache of
    the prompt and tokens ``0..k-2``, then the new weights run tokens ``k-1..`` on top of it (one unpadded row)."""
    ids = torch.tensor([prompt + tokens])  # [1, P + L]
    cut = len(prompt) + k - 1  # tokens before index cut were cached by the old weights
    cache = old(input_ids=ids[:, :cut], use_cache=True).past_key_values
    positions = torch.arange(cut, ids.shape[1] - 1)[None]  # [1, L - k]
    logits = new(input_ids=ids[:, cut:-1], position_ids=positions, past_key_values=cache, use_cache=True).logits
    return _logp(logits, tokens[k:])


@torch.no_grad()
def _full_forward(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """Logprobs of every response token under one full forward of ``model`` (no cache from anything else)."""
    ids = torch.tensor([prompt + tokens])
    logits = model(input_ids=ids).logits[:, len(prompt) - 1:-1]  # [1, L, V]: logits that predict each token
    return _logp(logits, tokens)


@dataclass(frozen=True)
class SwapErrors:
    """|engine logprob - reference| per token of a generation whose weights changed before token k: ``before``
    (tokens < k against a full forward of the old weights), ``after`` (tokens >= k against the new weights run on
    the old weights' cache), and the two wrong references for tokens >= k (old weights, full forward of new)."""

    before: np.ndarray
    after: np.ndarray
    after_old: np.ndarray
    after_full: np.ndarray


def swap_errors(old, new, prompts, groups, k: int, start: int) -> SwapErrors:
    """Check every sample's versions (``start`` before token k, ``start + 1`` from it) and measure
    :class:`SwapErrors`; asserts at least 6 samples reach past k and that both wrong references miss, so the
    caller's bounds on ``before``/``after`` can fail."""
    long_ones, parts = 0, ([], [], [], [])
    for prompt, group in zip(prompts, groups, strict=True):
        for s in group:
            n = len(s.token_ids)
            assert s.token_versions == [start] * min(n, k) + [start + 1] * max(0, n - k)
            logp = np.asarray(s.logprobs, dtype=np.float32)
            parts[0].append(np.abs(_full_forward(old, prompt, s.token_ids)[:k] - logp[:k]))
            if n > k:
                long_ones += 1
                parts[1].append(np.abs(_what_the_engine_conditions_on(old, new, prompt, s.token_ids, k) - logp[k:]))
                parts[2].append(np.abs(_full_forward(old, prompt, s.token_ids)[k:] - logp[k:]))
                parts[3].append(np.abs(_full_forward(new, prompt, s.token_ids)[k:] - logp[k:]))
    assert long_ones >= 6
    errors = SwapErrors(*(np.concatenate(p) for p in parts))
    assert errors.after_old.mean() > 1e-2  # the new weights really produced tokens k..
    assert errors.after_full.mean() > 1e-2  # and the cache of tokens < k really is the old weights'
    return errors
