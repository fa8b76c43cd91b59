"""The ``server`` engine's requests and answers: the body of one prompt's request, and each sample read back.

Consumes: a prompt's token ids and the sampling settings; a server's JSON answer to ``/inference/v1/generate``.
Produces: the request body (:func:`request_body`), the answer's choices in index order (:func:`choices_of`), and per
sample its token ids, logprobs, per-token versions and finish reason (:func:`parse_choice`).
Guarantees: every sampling control is sent explicitly with vLLM's meanings; an answer that lacks token ids, one
logprob per token or contiguous weight-version spans raises :class:`~producers.engines.base.EngineError` naming
the server (the engine then treats that server as broken).
"""

from __future__ import annotations

import uuid
from typing import Any

from producers.engines.base import EngineError, Sampling


def request_body(ids: list[int], n: int, sampling: Sampling, max_new_tokens: int, seed: int) -> dict[str, Any]:
    """The ``/inference/v1/generate`` body of one prompt: every control explicit, vLLM's meanings."""
    params = {"n": n, "temperature": sampling.temperature, "top_k": max(sampling.top_k, 0), "top_p": sampling.top_p,
              "min_p": sampling.min_p, "stop": list(sampling.stop), "stop_token_ids": list(sampling.stop_token_ids),
              "include_stop_str_in_output": True, "max_tokens": max_new_tokens, "logprobs": 0, "seed": seed,
              "detokenize": bool(sampling.stop), "repetition_penalty": 1.0, "presence_penalty": 0.0,
              "frequency_penalty": 0.0, "ignore_eos": False}
    return {"token_ids": list(ids), "sampling_params": params, "output_mode": "tokens",
            "request_id": f"stream-rl-{uuid.uuid4().hex}"}


def span_versions(spans: list[dict] | None, length: int, url: str) -> list[int]:
    """Per-token versions [R] from vLLM's weight version spans (``[{"version", "start", "end"}]``)."""
    if not spans:
        raise EngineError(f"{url} answered without weight version spans")
    versions: list[int] = []
    for span in spans:
        label = str(span.get("version"))
        if not label.isdigit():
            raise EngineError(f"{url} generated with weights labelled {label!r}, not a stream-rl version")
        if int(span["start"]) != len(versions):
            raise EngineError(f"{url}: weight version spans are not contiguous ({spans})")
        versions += [int(label)] * (int(span["end"]) - int(span["start"]))
    if len(versions) != length:
        raise EngineError(f"{url}: weight version spans cover {len(versions)} tokens, the answer has {length}")
    return versions


def parse_choice(choice: dict, url: str) -> tuple[list[int], list[float], list[int], str]:
    """Token ids, their logprobs, their versions and the finish reason of one answered sample."""
    tokens = choice.get("token_ids")
    content = (choice.get("logprobs") or {}).get("content")
    if not isinstance(tokens, list) or not tokens:
        raise EngineError(f"{url} answered a sample without token ids")
    if not isinstance(content, list) or len(content) != len(tokens):
        raise EngineError(f"{url} answered a sample without one logprob per token")
    logprobs = []
    for token, entry in zip(tokens, content, strict=True):
        if entry.get("token_id") != token:
            raise EngineError(f"{url}: the logprob entries do not follow the sampled tokens")
        logprobs.append(float(entry["logprob"]))
    versions = span_versions(choice.get("weight_versions"), len(tokens), url)
    return [int(t) for t in tokens], logprobs, versions, str(choice.get("finish_reason"))


def choices_of(answer: object, url: str) -> list[dict]:
    """The answer's choices in index order, or :class:`EngineError` naming what is missing."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not all(isinstance(c, dict) and isinstance(c.get("index"), int)
                                                for c in choices):
        raise EngineError(f"{url} answered a generation request without indexed choices: {str(answer)[:200]}")
    return sorted(choices, key=lambda c: c["index"])
