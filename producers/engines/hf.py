"""The ``hf`` engine: a transformers causal LM sampled by our own decode loop, with exact behaviour logprobs.

Consumes: a causal LM and its tokenizer (from a local ``save_pretrained`` directory), prompts as token ids.
Produces: :class:`~producers.engines.base.Sample` groups (see the guarantees in ``base.py``).

The loop (:func:`sample_groups`): each of the B prompts is prefilled once (left-padded ``[B, P]``, a key/value
cache), the cache is repeated for its n samples, and each step feeds the B*n last tokens ``[B*n, 1]``. Prefilling
B prompts instead of B*n rows is what ``generate(num_return_sequences=n)`` does not do: on the demo (32 prompts x 8)
the prefill was half of the generation time.

How the behaviour logprobs are exact: at each step the last-position logits ``[B*n, V]`` become
:func:`~producers.engines.truncation.truncated_logprobs` (``log softmax(logits / T)`` after min-p, top-k and
top-p, in vLLM's order; ``-inf`` outside the kept set), the token is drawn from ``softmax`` of exactly that, and
that row's logprob of the drawn token is kept. Memory stays O(B*n*V), never O(B*n*T*V). A row that has produced a
stop token (eos or ``Sampling.stop_token_ids``) or completed a stop string
(:class:`~producers.engines.stops.StopStrings`) gets the pad token afterwards (cut off by
:func:`~producers.engines.base.cut_at_stop`); the loop ends when every row has stopped or after ``max_new_tokens``
steps. :func:`score_tokens` computes the same logprobs for given
tokens (teacher forcing), to compare engines on the same tokens.

No batch barrier (``generate(..., on_group=...)``): the loop checks after each step which prompts' n rows have all
stopped and hands those groups to the caller at once, so a group is published when its own last sample ends, not
when the batch's longest one does (the producer's ``producer.stream_groups``). The check reads only the ``running``
flags: tokens, logprobs and the RNG stream are those of a call without it. With ``stop_when`` the loop may stop
before its long tail ends (``producer.oversample``); ``on_cut`` then receives each cut group's prefixes (the rows'
tokens, logprobs and versions up to the stop, an ended row whole), which :mod:`producers.partials` makes durable
and resumes by plain continuation from prompt + prefix token ids.

Randomness: each call forks torch's RNG and seeds it with ``prompt_seed(seed, 0)``, so the same seed gives the
same samples and the caller's RNG is left untouched; the whole batch is drawn from one stream, one
``torch.multinomial`` per step, as transformers' ``generate`` draws them. Position ids under left padding are
``cumsum(attention_mask) - 1``, as the trainer uses.

In-flight weight updates (``producer.inflight_updates``, :class:`Inflight`): before the decode step that computes
the logits of token k, for k = every, 2*every, ..., the loop calls the producer's hook, which may replace the
weights in place (``load_weights``: all or nothing). Token k and the tokens after it are drawn from, and their
behaviour logprobs computed by, the new weights, and record the new version. The key/value cache of the prompt and
of tokens 0..k-2 stays as the old weights computed it (token k-1 is the first input the new weights see): that is
the accepted approximation of in-flight updates (PipelineRL makes the same one), and the reason a recomputation of
tokens k.. under the new weights alone is not exactly their behaviour logprob (the off-policy weights absorb the
difference). Without a hook the
loop runs exactly the operations it always did: same tokens, same logprobs, bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from producers.engines.base import (
    EngineError, GenerationEngine, Sample, Sampling, WeightsHook, WeightsMismatch, check_generate_args, cut_at_stop,
    prompt_seed,
)
from producers.engines.stops import StopStrings
from producers.engines.truncation import truncated_logprobs


@dataclass(frozen=True)
class Inflight:
    """In-flight updates of one generation: ``swap()`` runs before the decode step of token k for k = ``every``,
    2 * ``every``, ... and returns the version the model holds afterwards; ``version`` is the one held at the
    start."""

    swap: Callable[[], int]
    every: int
    version: int


@dataclass(frozen=True)
class Stops:
    """What ends a row: any of the token ids ``ids`` [K] (kept), or a stop string (``strings``: None when there are
    none)."""

    ids: torch.Tensor
    strings: StopStrings | None = None


StopWhen = Callable[[list[bool]], bool]
"""``stop_when(done)``: end the decode loop now (``done[b]``: prompt b's group has ended); see :func:`sample_groups`."""
GroupHook = Callable[[int, list[Sample]], None]
"""``on_group(b, samples)``: prompt b's group of n samples has ended (see :meth:`HFEngine.generate`)."""
CutHook = Callable[[int, list[Sample], list[bool]], None]
"""``on_cut(b, samples, running)``: prompt b's group was cut by ``stop_when``; ``samples`` are its n prefixes and
``running[i]`` says sample i was still running (its prefix ends at the cut), else it had ended (whole)."""
GroupsDone = Callable[[list[int], torch.Tensor, torch.Tensor, "list[int] | None"], None]
"""Called inside the decode loop when prompts' groups have ended: (prompt indices [k], their rows' tokens
``[k*n, s]``, behaviour logprobs ``[k*n, s]``, the versions of the s steps so far or None)."""


def _report_done(on_done: GroupsDone, reported: torch.Tensor, running: torch.Tensor, n: int, tokens: list,
                 logprobs: list, versions: list | None) -> None:
    """Report the groups whose n rows have all stopped and were not reported yet (``reported`` [B], in place)."""
    done = ~running.view(-1, n).any(dim=1) & ~reported  # [B]
    if not bool(done.any()):
        return
    reported |= done
    prompts = done.nonzero().squeeze(1).tolist()
    rows = torch.tensor([b * n + i for b in prompts for i in range(n)], device=running.device)  # [k*n]
    on_done(prompts, torch.stack([t[rows] for t in tokens], dim=1), torch.stack([x[rows] for x in logprobs], dim=1),
            None if versions is None else list(versions))


@torch.inference_mode()
def sample_groups(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, n: int, sampling: Sampling,
                  max_new_tokens: int, stops: Stops, pad: int, inflight: Inflight | None = None,
                  on_done: GroupsDone | None = None,
                  stop_when: StopWhen | None = None) -> tuple[torch.Tensor, torch.Tensor, list[int] | None]:
    """Tokens ``[B*n, S]``, their behaviour logprobs ``[B*n, S]`` (S <= ``max_new_tokens``; row ``b*n + i`` is
    sample i of prompt b) from left-padded prompts ``input_ids``/``attention_mask`` ``[B, P]``, and with
    ``inflight`` the version that produced each step's tokens ``[S]`` (else None). ``stops.strings`` (rows in the
    same order) records where stop strings ended rows. With ``on_done`` each group whose n rows have all stopped
    before the loop ends is reported at the step its last row stopped (no barrier on the batch's longest sample);
    the drawn tokens and the RNG stream are the same with or without it. With ``stop_when`` the loop also ends
    after a step at which ``stop_when(done)`` (``done`` [B] bool: the groups whose rows have all stopped) is true:
    the rows still running are cut there (the caller decides what becomes of them)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    position = (attention_mask.cumsum(-1) - 1).clamp_min(0)  # [B, P]
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position, past_key_values=cache,
                use_cache=True, logits_to_keep=1)
    logits = out.logits[:, -1].float().repeat_interleave(n, dim=0)  # [B*n, V]
    cache = out.past_key_values
    cache.batch_repeat_interleave(n)  # [B, ...] -> [B*n, ...]
    mask = attention_mask.repeat_interleave(n, dim=0)  # [B*n, P]
    position = position[:, -1:].repeat_interleave(n, dim=0)  # [B*n, 1]
    running = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)  # [B*n]
    tokens, logprobs, versions = [], [], []
    version = inflight.version if inflight is not None else None
    reported = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=logits.device)  # [B] groups reported
    for step in range(max_new_tokens):
        versions.append(version)  # the weights that computed `logits`
        logp = truncated_logprobs(logits, sampling)  # [B*n, V], -inf outside the kept set
        drawn = torch.multinomial(torch.softmax(logp, dim=-1), num_samples=1).squeeze(1)  # [B*n]
        logprobs.append(logp.gather(-1, drawn[:, None]).squeeze(1))
        tokens.append(torch.where(running, drawn, pad))
        if stops.strings is not None:
            for row in stops.strings.step(drawn.tolist(), running.tolist()):
                running[row] = False  # its stop string is complete: the token stays, pads follow
        running &= ~torch.isin(drawn, stops.ids)
        if on_done is not None:
            _report_done(on_done, reported, running, n, tokens, logprobs, versions if inflight is not None else None)
        if step == max_new_tokens - 1 or not bool(running.any()):
            break
        if stop_when is not None and stop_when((~running.view(-1, n).any(dim=1)).tolist()):  # [B] groups ended
            break
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)  # [B*n, P + step + 1]
        position = position + 1
        if inflight is not None and (step + 1) % inflight.every == 0:
            version = inflight.swap()  # token step + 1 on: the weights held now (the cache stays)
        out = model(input_ids=tokens[-1][:, None], attention_mask=mask, position_ids=position,
                    past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1].float()  # [B*n, V]
    return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1), versions if inflight is not None else None


@torch.inference_mode()
def score_tokens(model, prompt: list[int], response: list[int], sampling: Sampling) -> list[float]:
    """The behaviour logprobs ``[R]`` the engine would report for ``response`` sampled after ``prompt``: one forward
    over both (teacher forcing), each response position's logits through
    :func:`~producers.engines.truncation.truncated_logprobs`, read at the given token (``-inf``: outside the kept
    set, a token this sampling could not have drawn)."""
    ids = torch.tensor([list(prompt) + list(response[:-1])], dtype=torch.long, device=model.device)  # [1, P+R-1]
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:].float()  # [R, V]
    logp = truncated_logprobs(logits, sampling)  # [R, V]
    targets = torch.tensor(list(response), dtype=torch.long, device=logp.device)[:, None]  # [R, 1]
    return logp.gather(-1, targets).squeeze(1).tolist()


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
    """Generation by :func:`sample_groups`; weights replaced in place by ``load_weights``, between calls or, through
    the hook of ``set_weights_hook``, between decode steps."""

    def __init__(self, model, tokenizer, *, version: int = 0):
        self.model = model.eval()
        for param in self.model.parameters():
            param.requires_grad_(False)
        self._tokenizer = tokenizer
        self._version = version
        self._hook: WeightsHook | None = None
        self._hook_every = 0
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.config.eos_token_id
        if isinstance(eos, list):
            eos = eos[0]
        if eos is None:
            raise EngineError("neither the tokenizer nor the model config names an eos token")
        self._eos = int(eos)
        self._pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self._eos)
        self._lora_base: dict[str, torch.Tensor] = {}  # W0 of every module an adapter version touched

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

    streams_groups = True  # generate(..., on_group=...) reports each group when its last sample ends
    cuts_groups = True  # generate(..., stop_when=..., on_cut=...) may stop before the long tail ends

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: Sampling, max_new_tokens: int,
                 seed: int, on_group: GroupHook | None = None, stop_when: StopWhen | None = None,
                 on_cut: CutHook | None = None) -> list[list[Sample]]:
        """:meth:`GenerationEngine.generate`; with ``on_group``, ``on_group(b, samples)`` is called once for every
        prompt b, from inside the decode loop at the step its group's last sample ended (groups still running
        when the loop ends: right after it), with the samples the return value holds for b. With ``stop_when``
        the loop may end before every group has (:func:`sample_groups`): such an aborted group is returned as an
        empty list and never handed to ``on_group``; with ``on_cut`` its prefixes are handed to ``on_cut`` (the
        tokens, logprobs and versions each row drew up to the cut, each ended row cut at its stop)."""
        check_generate_args(prompt_token_ids, n, sampling, max_new_tokens, self.max_model_len, self.vocab_size)
        if not prompt_token_ids:
            return []
        device = self.model.device
        input_ids, attention_mask = left_pad(prompt_token_ids, self._pad)  # (B, P)
        stop_ids, stops = self._stops(sampling, prompt_token_ids, n)
        ends = lambda: stops.strings.ends if stops.strings is not None else None  # noqa: E731  row -> stop end
        groups: dict[int, list[Sample]] = {}

        def done(prompts: list[int], toks: torch.Tensor, lps: torch.Tensor, versions: list[int] | None) -> None:
            row_ends = ends()
            for k, b in enumerate(prompts):
                groups[b] = [cut_at_stop(toks[k * n + i].tolist(), lps[k * n + i].tolist(), stop_ids, versions,
                                         None if row_ends is None else row_ends[b * n + i]) for i in range(n)]
                if on_group is not None:
                    on_group(b, groups[b])

        ended_at_stop: list[bool] = []  # set when stop_when ended the loop: which groups had ended then

        def stop(ended: list[bool]) -> bool:
            if stop_when(ended):
                ended_at_stop.extend(ended)
                return True
            return False

        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(prompt_seed(seed, 0))
            if devices:
                torch.cuda.manual_seed(prompt_seed(seed, 0))
            new_tokens, logprobs, versions = sample_groups(
                self.model, input_ids.to(device), attention_mask.to(device), n, sampling, max_new_tokens,
                stops, self._pad, self._inflight(), done if on_group is not None else None,
                stop if stop_when is not None else None)  # (B*n, S), (S) | None
        cut = [b for b, ended in enumerate(ended_at_stop) if not ended]  # still running when the loop was stopped
        for b in cut:
            groups[b] = []
        if on_cut is not None:
            self._hand_over_cut(on_cut, cut, n, new_tokens.cpu(), logprobs.cpu(), versions, stop_ids, ends())
        rest = [b for b in range(len(prompt_token_ids)) if b not in groups]  # ended, not handed over yet
        rows = torch.tensor([b * n + i for b in rest for i in range(n)], dtype=torch.long)
        done(rest, new_tokens.cpu()[rows], logprobs.cpu()[rows], versions)
        return [groups[b] for b in range(len(prompt_token_ids))]

    @staticmethod
    def _hand_over_cut(on_cut: CutHook, cut: list[int], n: int, tokens: torch.Tensor, logprobs: torch.Tensor,
                       versions: list[int] | None, stop_ids: frozenset[int], row_ends: list | None) -> None:
        """``on_cut`` for each cut prompt b: its rows' prefixes (``tokens``/``logprobs`` [B*n, S]); a row that
        stopped is cut at its stop (``"stop"``), a running one keeps its S tokens (the loop stopped before
        ``max_new_tokens``, so it never reads ``"stop"``)."""
        for b in cut:
            samples = [cut_at_stop(tokens[b * n + i].tolist(), logprobs[b * n + i].tolist(), stop_ids, versions,
                                   None if row_ends is None else row_ends[b * n + i]) for i in range(n)]
            on_cut(b, samples, [s.finish_reason != "stop" for s in samples])

    def _stops(self, sampling: Sampling, prompt_token_ids: list[list[int]], n: int) -> tuple[frozenset[int], Stops]:
        """The stop token ids and the loop's :class:`Stops` (rows: each prompt repeated ``n`` times)."""
        stop_ids = frozenset({self._eos, *sampling.stop_token_ids})
        strings = None
        if sampling.stop:
            strings = StopStrings(self._tokenizer, sampling.stop, [p for p in prompt_token_ids for _ in range(n)])
        ids = torch.tensor(sorted(stop_ids), dtype=torch.long, device=self.model.device)
        return stop_ids, Stops(ids, strings)

    def set_weights_hook(self, hook: WeightsHook | None, every: int) -> None:
        if hook is not None and every < 1:
            raise EngineError(f"the weights hook needs every >= 1 decode steps, got {every}")
        self._hook, self._hook_every = hook, every

    def _inflight(self) -> Inflight | None:
        if self._hook is None:
            return None
        hook = self._hook

        def swap() -> int:
            hook()  # may call self.load_weights (all or nothing)
            return self._version

        return Inflight(swap, self._hook_every, self._version)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        from stream_rl.models.loading import ModelLoadError, load_state_dict_strict

        if version < 0:
            raise EngineError(f"version must be >= 0, got {version}")
        try:
            load_state_dict_strict(self.model, state_dict)  # checks every name and shape before copying
        except ModelLoadError as exc:
            raise WeightsMismatch(str(exc)) from exc
        self._lora_base = {}  # full weights: the new base of any later adapter version
        self._version = version

    def load_adapter(self, adapter: Mapping[str, torch.Tensor], scale: float, version: int) -> None:
        """Apply a LoRA adapter version: ``W = W0 + scale * B A`` on each adapted module, ``W0`` the base weights
        kept from before the first adapter (:mod:`producers.engines.adapters`: no accumulation, all or
        nothing)."""
        from producers.engines.adapters import adapted_weights

        if version < 0:
            raise EngineError(f"version must be >= 0, got {version}")
        params = dict(self.model.named_parameters())
        new, self._lora_base = adapted_weights(params, self._lora_base, adapter, scale)
        with torch.no_grad():
            for name, value in new.items():
                params[name].copy_(value)
        self._version = version
