"""OpenRLHF's remote-reward protocol, as :mod:`stream_rl.rewards.server` serves it.

Consumes: the JSON body of a ``POST /get_reward`` from OpenRLHF's remote-reward clients, current and previous::

    {"query": [text, ...]}                                          # the oldest clients: query only
    {"queries": [text, ...], "prompts": [prompt, ...]}              # an older client's key
    {"query": [...], "prompts": [...], "labels": [label, ...]}      # current (labels of any JSON type;
                                                                    #  "references" in some versions)

where a query is ``tokenizer.decode(prompt + response tokens)``, so it may start with a decoded BOS or template text
before the prompt. Unknown fields (``metas``, ``datasources``) are ignored.
Produces: the batch to score, ``(prompts, responses, answers, metadatas)``, and the answer OpenRLHF reads::

    {"rewards": [float, ...],                  # never null: torch.tensor(rewards) must work
     "extra_logs": {"reward_failed": [0.0 | 1.0, ...]},   # per rollout, logged by OpenRLHF like serve_rm's
     "errors": [str | null, ...]}              # only when a rollout failed: its reason (OpenRLHF ignores it)

Guarantees (the documented rule):
- A request is OpenRLHF's when it has ``query`` (or ``queries``) and no ``responses``; ours stays strict.
- Each response is the text after the FIRST occurrence of its prompt in its query (what precedes, e.g. ``<s>``, is
  skipped); without prompts, the whole query is the response and the prompt is empty. A query that does not
  contain its prompt fails that rollout alone, with the reason.
- A label that is not a string is passed as its JSON text (``7`` -> ``"7"``, ``{"k": 1}`` -> ``'{"k": 1}'``);
  a null label is no answer. Metadata is empty.
- A failed rollout is answered the fallback reward (``stream-rl reward-server --openrlhf-fallback``, 0.0 by
  default), flagged 1.0 in ``extra_logs.reward_failed`` and explained in ``errors``.
"""

from __future__ import annotations

import json
from typing import Any

Batch = tuple[list[str], list[str], list["str | None"], list[dict]]


def is_openrlhf(body: Any) -> bool:
    """A request in OpenRLHF's shape: an object with ``query`` (or ``queries``) and without our ``responses``."""
    return isinstance(body, dict) and "responses" not in body and ("query" in body or "queries" in body)


def parse_openrlhf(body: dict) -> tuple[Batch, dict[int, Exception]]:
    """The batch of an OpenRLHF request and the rollouts that cannot be scored (``{i: ValueError}``, a query without
    its prompt); ValueError naming a wrong field."""
    key = "query" if "query" in body else "queries"
    queries = strings(body, key)
    n = len(queries)
    prompts = body.get("prompts")
    if prompts is None:
        prompts = [""] * n
    elif not (isinstance(prompts, list) and len(prompts) == n and all(isinstance(p, str) for p in prompts)):
        raise ValueError(f"'prompts' must be a list of {n} strings (one per {key})")
    labels = body.get("labels", body.get("references"))
    if labels is None:
        labels = [None] * n
    elif not isinstance(labels, list) or len(labels) != n:
        raise ValueError(f"'labels' must be a list of {n} (one per {key})")
    answers = [None if a is None else a if isinstance(a, str) else json.dumps(a) for a in labels]
    responses: list[str] = []
    failed: dict[int, Exception] = {}
    for i, (query, prompt) in enumerate(zip(queries, prompts)):
        at = query.find(prompt)
        if at < 0:
            failed[i] = ValueError(f"the {key} does not contain its prompt, so its response cannot be told apart")
        responses.append(query[at + len(prompt):] if at >= 0 else "")
    return (prompts, responses, answers, [{} for _ in range(n)]), failed


def openrlhf_answer(answer: dict[str, Any], fallback: float) -> dict[str, Any]:
    """Our answer (``{"rewards": [float | null], "errors"?}``) in the shape OpenRLHF reads (module docstring)."""
    failed = [reward is None for reward in answer["rewards"]]
    out: dict[str, Any] = {"rewards": [fallback if f else r for r, f in zip(answer["rewards"], failed)],
                           "extra_logs": {"reward_failed": [float(f) for f in failed]}}
    if "errors" in answer:
        out["errors"] = answer["errors"]
    return out


def strings(body: dict, key: str) -> list[str]:
    """``body[key]`` when it is a list of strings; ValueError naming ``key`` otherwise."""
    values = body.get(key)
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"'{key}' must be a list of strings")
    return values
