"""Reference-model log-probabilities of rollout responses, batched.

Consumes: rollouts (``prompt_token_ids [P]``, ``response_token_ids [R]``, ``temperature``) and a frozen causal LM
(loaded strictly by :func:`stream_rl.models.loading.load_reference`, or given directly).
Produces: per rollout, ``ref_logprobs`` float32 ``[R]`` with
``ref_logprobs[i] = log pi_ref(response[i] | prompt + response[:i])``.

How: prompt and response are concatenated, right-padded into one ``[B, L]`` batch with an attention mask, and run
once. With right padding every real token keeps its position ``0..P+R-1`` (no position ids to fix), and causal
attention never lets a real token see the padding after it, so a row's values equal those of the row run alone.
The logits at positions ``P-1 .. P+R-2`` predict the response tokens. Only positions from the shortest prompt on
are projected to the vocabulary (``logits_to_keep``), and the float32 log-softmax is done one row at a time
(``[R, V]``), so the float32 working set is one response's logits, not the batch's.

Temperature (a choice, stated here once): the logits are divided by the rollout's own ``temperature`` before the
log-softmax, exactly as the behaviour log-probabilities and the trainer's recomputation are (design contract:
logits / temperature, full softmax, no top-k/top-p). With the policy equal to the reference, ``ref_logprobs``
then equal the trainer's log-probabilities and the KL term is exactly zero; a temperature-1 reference would
instead make the KL non-zero at initialisation whenever the sampling temperature is not 1, penalising the
temperature rather than the policy's drift. Rollouts of different temperatures may share a batch.

Precision: the model runs in the dtype it was loaded in (``scorer.dtype``; a frozen model needs no float32 master
copy). Its logits stay in that dtype; :func:`~stream_rl.algorithms.logprobs.logprobs_from_logits` upcasts one chunk
of rows at a time to float32 and does the division and the log-softmax there, so only the forward pass is 16-bit.

Guarantees: float32 results (16-bit logits are upcast per chunk before the division), finite and <= 0 or the
rollout is reported; ``check`` rejects a rollout the model cannot score (a token id outside the vocabulary, a
sequence longer than ``max_position_embeddings``) with the reason, before any forward pass. No gradients.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence

import numpy as np
import torch

from schemas import Rollout
from stream_rl.algorithms.logprobs import logprobs_from_logits


def right_pad(sequences: Sequence[np.ndarray], pad_id: int,
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id sequences -> ``(input_ids [B, L] int64, attention_mask [B, L] int64)``, padding on the right."""
    length = max(len(seq) for seq in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, :len(seq)] = torch.as_tensor(np.asarray(seq), dtype=torch.long)
        mask[row, :len(seq)] = 1
    return ids.to(device), mask.to(device)


class ReferenceLogprobs:
    """Batched log pi_ref of response tokens under a frozen causal LM (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, *, batch_size: int = 16, device: str | torch.device = "cpu"):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.batch_size = batch_size
        text_config = model.config.get_text_config()
        self.vocab_size = int(text_config.vocab_size)
        self.max_positions = getattr(text_config, "max_position_embeddings", None)
        pad = getattr(text_config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0  # any id works: padded positions are never read
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    @classmethod
    def from_dir(cls, path: str | os.PathLike, *, dtype: str = "float32", batch_size: int = 16,
                 device: str | torch.device = "cpu") -> ReferenceLogprobs:
        """Load the reference strictly from a local directory (every weight key checked), its weights in ``dtype``
        (``scorer.dtype``: float32, bfloat16 or float16)."""
        from stream_rl.models import load_reference, torch_dtype

        model, _ = load_reference(path, dtype=torch_dtype(dtype), device=device)
        return cls(model, batch_size=batch_size, device=device)

    def check(self, rollout: Rollout) -> None:
        """Raise ValueError with the reason if this model cannot score ``rollout``."""
        check_token_ids([("prompt", rollout.prompt_token_ids), ("response", rollout.response_token_ids)],
                        self.vocab_size, self.max_positions, "reference model")

    def logprobs(self, rollouts: Sequence[Rollout]) -> list[np.ndarray]:
        """``ref_logprobs`` float32 ``[R_i]`` for each rollout, in order (call :meth:`check` first)."""
        out: list[np.ndarray] = []
        for start in range(0, len(rollouts), self.batch_size):
            out.extend(self._batch(rollouts[start:start + self.batch_size]))
        return out

    @torch.inference_mode()
    def _batch(self, rollouts: Sequence[Rollout]) -> list[np.ndarray]:
        sequences = [np.concatenate([r.prompt_token_ids, r.response_token_ids]) for r in rollouts]
        ids, mask = right_pad(sequences, self.pad_id, self.device)  # [B, L]
        first = min(len(r.prompt_token_ids) for r in rollouts) - 1  # first position whose logits are needed
        extra = {"logits_to_keep": ids.shape[1] - first} if self._keeps_logits else {}
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False, **extra).logits  # [B, K, V]
        offset = ids.shape[1] - logits.shape[1]  # sequence position of logits[:, 0]
        out = []
        for row, rollout in enumerate(rollouts):
            n_prompt, n_response = len(rollout.prompt_token_ids), len(rollout.response_token_ids)
            begin = n_prompt - 1 - offset
            labels = torch.as_tensor(rollout.response_token_ids, dtype=torch.long, device=self.device)  # [R]
            # 1 / T applied inside the chunked kernel: no float32 copy of the row's [R, V] logits
            logp = logprobs_from_logits(logits[row, begin:begin + n_response], labels,
                                        temperature=rollout.temperature).clamp_(max=0.0)  # [R]
            out.append(logp.cpu().numpy().astype(np.float32))
        return out


def check_token_ids(parts: Sequence[tuple[str, np.ndarray]], vocab_size: int, max_positions: int | None,
                    what: str) -> None:
    """Raise ValueError if an id of the named ``parts`` is outside ``[0, vocab_size)`` or their total length
    exceeds ``max_positions`` of ``what`` (the model's name in the message)."""
    for name, ids in parts:
        if len(ids) and int(ids.max()) >= vocab_size:
            raise ValueError(f"{name} token id {int(ids.max())} is outside the {what}'s vocabulary "
                             f"of {vocab_size} tokens")
    total = sum(len(ids) for _, ids in parts)
    if max_positions is not None and total > max_positions:
        raise ValueError(f"{' + '.join(name for name, _ in parts)} is {total} tokens, more than the {what}'s "
                         f"max_position_embeddings {max_positions}")
