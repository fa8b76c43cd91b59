"""The ``hf`` engine: transformers ``generate`` on left-padded batches, with exact behaviour logprobs.

Consumes: a causal LM and its tokenizer (from a local ``save_pretrained`` directory), prompts as token ids.
Produces: :class:`~producers.engines.base.Sample` groups (see the guarantees in ``base.py``).

How the behaviour logprobs are exact: ``generate`` runs with a generation config that adds no processing of its
own (``do_sample=True``, temperature 1, ``top_k=0``, ``top_p=1``; the model's own generation config is replaced
by a neutral one when the engine is built, because ``generate`` fills unset fields from it). The only logits
processor is :class:`_TemperatureLogSoftmax`: it receives the raw last-position logits [B*n, V], returns
``log softmax(logits / T)`` (``generate`` then samples from ``softmax`` of that, i.e. from exactly that
distribution), and keeps that one row: at the next step the sampled token is the last column of ``input_ids``,
so it gathers the token's logprob and drops the row. Memory stays O(B*n*V), never O(B*n*T*V), and nothing is
recomputed from ``generate``'s processed scores.

Randomness: ``generate`` samples with torch's global generator; each call forks the RNG state and seeds it, so
the same seed gives the same samples and the caller's RNG is left untouched. The whole batch is sampled from one
stream seeded with ``prompt_seed(seed, 0)``; prompts of a batch still get independent samples (one stream, many
draws). Position ids under left padding are ``cumsum(attention_mask) - 1``, as the trainer uses.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from producers.engines.base import (
    EngineError, GenerationEngine, Sample, WeightsMismatch, check_generate_args, cut_at_stop, prompt_seed,
)


class _TemperatureLogSoftmax:
    """Logits processor: ``log softmax(logits / T)``; records the logprob of each token sampled from it."""

    def __init__(self, temperature: float, prompt_len: int):
        self.temperature = temperature
        self.prompt_len = prompt_len
        self.steps: list[torch.Tensor] = []  # logprob of the token sampled at step t, each [B*n]
        self.pending: torch.Tensor | None = None  # last step's log-distribution [B*n, V]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:  # input_ids[:, -1] was sampled from self.pending
            self._gather(input_ids[:, -1])
        self.pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # (B*n, V)
        return self.pending

    def _gather(self, tokens: torch.Tensor) -> None:
        self.steps.append(self.pending.gather(-1, tokens[:, None]).squeeze(-1))  # (B*n,)
        self.pending = None

    def logprobs(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """Logprobs [B*n, T] of the ``new_tokens`` [B*n, T] that ``generate`` returned."""
        steps = new_tokens.shape[1]
        if len(self.steps) < steps and self.pending is not None:
            self._gather(new_tokens[:, len(self.steps)])
        if len(self.steps) < steps:
            raise EngineError(f"generate returned {steps} tokens but sampled only {len(self.steps)} steps")
        return torch.stack(self.steps[:steps], dim=1)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` [B, P_max], prompts aligned to the right."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids, mask


class HFEngine(GenerationEngine):
    """Generation with transformers ``generate``; weights replaced in place by ``load_weights``."""

    def __init__(self, model, tokenizer, *, version: int = 0):
        from transformers import GenerationConfig

        self.model = model.eval()
        for param in self.model.parameters():
            param.requires_grad_(False)
        self._tokenizer = tokenizer
        self._version = version
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.config.eos_token_id
        if isinstance(eos, list):
            eos = eos[0]
        if eos is None:
            raise EngineError("neither the tokenizer nor the model config names an eos token")
        self._eos = int(eos)
        self._pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self._eos)
        # generate() fills unset fields from model.generation_config: make it neutral (no penalties, no top-k).
        self.model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=self._eos, pad_token_id=self._pad)

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike, *, device: str = "cpu", dtype: str = "float32",
                 version: int = 0) -> HFEngine:
        """Load the policy in ``model_dir`` with the strict loader (key checks, safetensors only) on ``device``
        (``producer.device``; ``auto``: CUDA when torch sees one, else CPU) in ``dtype`` (``producer.dtype``)."""
        from stream_rl.models import load_policy, resolve_device, torch_dtype

        placed = resolve_device(device, "producer.device")  # before any weights are read
        model, tokenizer = load_policy(model_dir, dtype=torch_dtype(dtype), device=placed)
        return cls(model, tokenizer, version=version)

    @property
    def max_model_len(self) -> int:
        return int(self.model.config.max_position_embeddings)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def generate(self, prompt_token_ids: list[list[int]], n: int, temperature: float, max_new_tokens: int,
                 seed: int) -> list[list[Sample]]:
        from transformers import GenerationConfig, LogitsProcessorList

        check_generate_args(prompt_token_ids, n, temperature, max_new_tokens, self.max_model_len, self.vocab_size)
        if not prompt_token_ids:
            return []
        device = self.model.device
        input_ids, attention_mask = left_pad(prompt_token_ids, self._pad)  # (B, P)
        recorder = _TemperatureLogSoftmax(temperature, input_ids.shape[1])
        config = GenerationConfig(
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n,
            max_new_tokens=max_new_tokens, eos_token_id=self._eos, pad_token_id=self._pad, use_cache=True)
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            torch.manual_seed(prompt_seed(seed, 0))
            if devices:
                torch.cuda.manual_seed(prompt_seed(seed, 0))
            sequences = self.model.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=config,
                logits_processor=LogitsProcessorList([recorder]))  # (B*n, P + T)
        new_tokens = sequences[:, input_ids.shape[1]:]  # (B*n, T)
        logprobs = recorder.logprobs(new_tokens).cpu()  # (B*n, T)
        stops = frozenset({self._eos})
        flat = [cut_at_stop(toks, lps, stops)
                for toks, lps in zip(new_tokens.cpu().tolist(), logprobs.tolist(), strict=True)]
        return [flat[i * n:(i + 1) * n] for i in range(len(prompt_token_ids))]

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        from stream_rl.models.loading import ModelLoadError, load_state_dict_strict

        if version < 0:
            raise EngineError(f"version must be >= 0, got {version}")
        try:
            load_state_dict_strict(self.model, state_dict)  # checks every name and shape before copying
        except ModelLoadError as exc:
            raise WeightsMismatch(str(exc)) from exc
        self._version = version
