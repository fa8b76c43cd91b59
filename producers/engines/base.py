"""The interface every generation engine implements, and the small rules engines share.

Consumes: prompts as token-id lists, sampling settings, and state dicts of new policy weights.
Produces: for each prompt, ``n`` :class:`Sample` objects (token ids, behaviour logprobs, finish reason).

Guarantees every engine gives (``tests/integration/test_producers.py``, ``test_sampling_hf.py`` and
``test_vllm_engine.py`` check them):
- ``Sample.logprobs[i]`` is the log-probability of ``token_ids[i]`` under the exact distribution it was sampled
  from (:class:`Sampling`, :func:`producers.engines.truncation.truncated_logprobs`): ``log softmax(logits_i / T)``
  restricted to the tokens min-p, top-k and top-p keep (in vLLM's order) and renormalised over them. Without
  truncation (the defaults) that is the full tempered softmax the trainer recomputes
  (``stream_rl.algorithms.logprobs_from_logits``); with it, the truncated distribution importance sampling needs.
- A sample ends at the first stop token (the eos token or one of ``Sampling.stop_token_ids``), at the first token
  that completes a stop string (``Sampling.stop``, matched on the decoded response text as vLLM matches it), both
  kept in the response (``finish_reason="stop"``), or after ``max_new_tokens`` tokens (``"length"``); it has at
  least one token.
- The same weights, prompts, settings and ``seed`` give the same samples. Prompt ``i`` of a batch samples with
  :func:`prompt_seed` ``(seed, i)``, so prompts of one batch never share random streams.
- ``load_weights`` either replaces every weight and moves ``version`` to the new value, or raises
  :class:`WeightsMismatch` before touching anything (missing, unexpected or wrongly shaped tensors): the engine
  never runs on a mix of two versions.
- ``load_adapter`` (a LoRA version, ``trainer.lora``) has the same all-or-nothing rule, and versions never
  accumulate (v1 then v2 gives what v2 alone gives): both engines merge ``W0 + scale * B A``
  (:mod:`producers.engines.adapters`); ``hf`` into the base weights it keeps, ``vllm`` into the checkpoint's
  weights, reloaded in full (it refuses an adapter version after a full-weight version: it keeps no other base).
- In-flight updates (``set_weights_hook``, engines that support them: ``hf``, ``vllm``, ``server``): between
  decode steps, every ``every`` tokens (``server``: every ``every`` x 0.05 s while requests run), the engine calls
  the hook, which may replace the weights through ``load_weights`` (all or nothing); each token then records the
  version that produced it in ``Sample.token_versions``. Without a hook
  ``token_versions`` is None: every token comes from the version held when ``generate`` was called.
- Long tails (engines with ``cuts_groups``: ``hf``, ``vllm``, ``server``): ``generate(..., stop_when=..., on_cut=...)`` may
  stop before every group has ended; the ended groups are those of a call without it, a cut group is returned
  empty and its prefixes (tokens, logprobs, versions so far; an ended sample whole) go to ``on_cut``. Resuming
  such a prefix is plain ``generate`` from prompt + prefix token ids (:mod:`producers.partials`), which every
  engine supports.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length"]
SEED_MODULUS = 2**31 - 1  # vLLM and torch both accept seeds below 2**31
_SHOW = 5


WeightsHook = Callable[[], None]
"""Called by an engine between decode steps of a generation; it may replace the engine's weights through the
engine's own ``load_weights`` (a complete, verified version: never part of one) and must not wait for a version
that is not complete. The engine reads its ``version`` after each call."""


class EngineError(RuntimeError):
    """The engine cannot do what was asked (bad arguments, an unexpected engine result)."""


class WeightsMismatch(EngineError):
    """A state dict does not fit the engine's model; nothing was loaded and the version did not change."""


@dataclass(frozen=True)
class Sample:
    """One sampled response: ``token_ids`` [R], ``logprobs`` [R] (behaviour logprobs), why it ended, and
    ``token_versions`` [R], the policy version that produced each token (None: all the version held when
    ``generate`` was called, i.e. no weights changed during the call)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    token_versions: list[int] | None = None


@dataclass(frozen=True)
class Sampling:
    """How each token is drawn (``producer.temperature``, ``top_k``, ``top_p``, ``min_p``, ``stop``,
    ``stop_token_ids``), with vLLM's meanings: ``top_k`` 0 or -1 is off, ``top_p`` 1 is off, ``min_p`` 0 is off.

    Stop strings and stop token ids end a sample with ``finish_reason="stop"``; the tokens that complete them stay
    in the response (their behaviour logprobs are real, the trainer trains on them)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    @property
    def truncates(self) -> bool:
        """Whether min-p, top-k or top-p can remove a token (else the full tempered softmax is sampled)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def check(self, vocab_size: int | None = None) -> None:
        """Raise :class:`EngineError` naming the first bad setting (token ids against ``vocab_size`` if given)."""
        if not self.temperature > 0.0:
            raise EngineError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < -1:
            raise EngineError(f"producer.top_k must be 0 or -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise EngineError(f"producer.top_p must lie in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise EngineError(f"producer.min_p must lie in [0, 1), got {self.min_p}")
        if any(not s for s in self.stop):
            raise EngineError("producer.stop: an empty stop string would end every sample at once")
        for token in self.stop_token_ids:
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise EngineError(f"producer.stop_token_ids: {token} is outside the vocabulary [0, {vocab_size})")


def check_stop_strings(stop: Sequence[str], tokenizer: Any) -> None:
    """Raise :class:`EngineError` naming ``producer.stop`` and the string when the tokenizer cannot write a stop
    string (encoding raises, yields nothing or an unknown token, or does not decode back to it): such a string could
    never appear in a decoded response."""
    unk = getattr(tokenizer, "unk_token_id", None)
    for text in stop:
        try:
            ids = list(tokenizer.encode(text, add_special_tokens=False))
        except Exception as exc:  # noqa: BLE001 - tokenizers raise plain Exception for characters outside the vocab
            raise EngineError(f"producer.stop: the tokenizer cannot encode {text!r} ({exc})") from exc
        decoded = tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
        if not ids or (unk is not None and unk in ids) or text.strip() not in decoded:
            raise EngineError(f"producer.stop: the tokenizer cannot encode {text!r} (it encodes to {ids}, which "
                              f"decodes to {decoded!r})")


class GenerationEngine(ABC):
    """Samples groups of responses from a policy whose weights can be replaced between calls."""

    # Engines set these three in __init__ (and ``_version`` in ``load_weights``).
    _version: int
    _eos: int
    _tokenizer: Any

    @property
    def version(self) -> int:
        """Policy version of the weights in use (0 for the weights loaded from the model directory)."""
        return self._version

    @property
    def eos_token_id(self) -> int:
        """The stop token: sampling it ends a response (it is kept as the response's last token)."""
        return self._eos

    @property
    def tokenizer(self) -> Any:
        """The policy's Hugging Face tokenizer (for tokenising prompts and decoding responses)."""
        return self._tokenizer

    @property
    @abstractmethod
    def max_model_len(self) -> int:
        """Longest prompt + response, in tokens, the engine can run."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of rows of the output head: token ids must be below it."""

    @abstractmethod
    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: Sampling, max_new_tokens: int,
                 seed: int) -> list[list[Sample]]:
        """``n`` samples for each prompt drawn as ``sampling`` says, in prompt order then sample order (see the
        module guarantees)."""

    def check_sampling(self, sampling: Sampling) -> None:
        """Raise :class:`EngineError` naming the field when this engine cannot sample as ``sampling`` says (bad
        values, a stop token id outside the vocabulary, a stop string the tokenizer cannot write)."""
        sampling.check(self.vocab_size)
        check_stop_strings(sampling.stop, self.tokenizer)

    @abstractmethod
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace every weight by ``state_dict`` and set ``version``; raise :class:`WeightsMismatch` first if
        the tensors do not fit."""

    def load_adapter(self, adapter: Mapping[str, torch.Tensor], scale: float, version: int) -> None:
        """Apply a LoRA adapter version (``W = W0 + scale * B A`` on the base weights) and set ``version``;
        engines without adapter support refuse the version with :class:`WeightsMismatch` (nothing changes)."""
        raise WeightsMismatch(f"the {type(self).__name__} engine does not apply LoRA adapter versions "
                              f"(trainer.lora needs producer.engine = \"hf\" or \"vllm\")")

    def set_weights_hook(self, hook: WeightsHook | None, every: int) -> None:
        """Call ``hook`` every ``every`` decode steps of each generation (None: never, the default); engines that
        cannot change weights between decode steps refuse with :class:`EngineError`."""
        if hook is not None:
            raise EngineError(f"the {type(self).__name__} engine cannot change weights during a generation "
                              f"(producer.inflight_updates needs producer.engine = \"hf\", \"vllm\" or \"server\")")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine's resources (default: nothing to do)."""


def check_generate_args(prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: Sampling,
                        max_new_tokens: int, max_model_len: int, vocab_size: int) -> None:
    """Raise :class:`EngineError` naming the first bad argument of a ``generate`` call."""
    if n < 1:
        raise EngineError(f"n must be >= 1, got {n}")
    if not isinstance(sampling, Sampling):
        raise EngineError(f"sampling must be a producers.engines.base.Sampling, got {type(sampling).__name__}")
    sampling.check(vocab_size)
    if max_new_tokens < 1:
        raise EngineError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for i, ids in enumerate(prompt_token_ids):
        if len(ids) == 0:
            raise EngineError(f"prompt {i} is empty")
        if len(ids) + max_new_tokens > max_model_len:
            raise EngineError(f"prompt {i}: {len(ids)} tokens + max_new_tokens {max_new_tokens} > "
                              f"max_model_len {max_model_len}")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise EngineError(f"prompt {i}: token ids must lie in [0, {vocab_size}), got {min(ids)}..{max(ids)}")


def prompt_seed(seed: int, index: int) -> int:
    """Seed of prompt ``index`` of a batch sampled with ``seed``: a hash, so nearby seeds do not overlap."""
    digest = hashlib.sha256(f"stream-rl/prompt-seed/{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % SEED_MODULUS


def cut_at_stop(token_ids: Sequence[int], logprobs: Sequence[float], stop_ids: frozenset[int],
                versions: Sequence[int] | None = None, string_end: int | None = None) -> Sample:
    """The sample made of the tokens up to and including the first stop token or, when ``string_end`` is given,
    the token that completed a stop string (token ``string_end - 1``), whichever comes first (``"stop"``); else
    all of them (``"length"``). ``versions`` (one per token, or None) is cut the same way."""
    end = next((i + 1 for i, token in enumerate(token_ids) if token in stop_ids), len(token_ids))
    stopped = end < len(token_ids) or (end > 0 and token_ids[end - 1] in stop_ids)
    if string_end is not None and string_end <= end:
        end, stopped = string_end, True
    if end == 0:
        raise EngineError("the engine returned an empty response")
    kept = None if versions is None else [int(v) for v in versions[:end]]
    return Sample([int(t) for t in token_ids[:end]], [float(x) for x in logprobs[:end]],
                  "stop" if stopped else "length", kept)


def check_state_dict(expected: Mapping[str, tuple[int, ...]], state_dict: Mapping[str, Any]) -> None:
    """Raise :class:`WeightsMismatch` unless ``state_dict`` has exactly the ``expected`` names and shapes."""
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    mismatched = sorted(f"{name} (given {list(state_dict[name].shape)}, model {list(shape)})"
                        for name, shape in expected.items()
                        if name in state_dict and tuple(state_dict[name].shape) != tuple(shape))
    parts = [f"{len(names)} {label}: {', '.join(names[:_SHOW])}{' ...' if len(names) > _SHOW else ''}"
             for label, names in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mismatched))
             if names]
    if parts:
        raise WeightsMismatch("state dict does not fit the model: " + "; ".join(parts))
