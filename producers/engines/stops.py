"""Stop strings for the ``hf`` engine's decode loop, matched on the decoded response as vLLM matches them.

Consumes: the policy tokenizer, the stop strings (``producer.stop``), each row's prompt ids, and every decode
step's new tokens.
Produces: per row, the response length at which a stop string was first completed (None: not yet).
Guarantees: the rule is vLLM 0.32's (``vllm/v1/engine/detokenizer.py``, ``check_stop_strings``): after each new
token, a stop string matches when it occurs in the response text and ends inside the characters that token added
(``text.find(stop, len(text) - new_chars - len(stop) + 1)``); the response text is decoded with
``skip_special_tokens=True`` (vLLM's default); the token that completes the string stays in the response (vLLM
keeps it in the token ids; the engine asks it to keep the string in the text too). A match never starts inside the
prompt.

Cost: each check decodes a window of the last ``4 * max(len(stop)) + 16`` tokens (with one prompt token before the
response as context, so a leading space of the first response token survives as it does in vLLM's primed
detokenizer), not the whole response: O(window) per row and step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class StopStrings:
    """Tracks each row of a batch; :meth:`step` reports the rows whose response just completed a stop string."""

    def __init__(self, tokenizer: Any, stop: Sequence[str], prompts: Sequence[Sequence[int]]):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.window = 4 * max((len(s) for s in self.stop), default=0) + 16
        self.rows = [list(p) for p in prompts]  # prompt + response so far, per row
        self.prompt_len = [len(p) for p in prompts]
        self.ends: list[int | None] = [None] * len(prompts)  # response length at the completing token

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def step(self, tokens: Sequence[int], running: Sequence[bool]) -> list[int]:
        """Append ``tokens`` (one per row) to the running rows; the rows a stop string ended at this token."""
        hits = []
        for row, (token, live) in enumerate(zip(tokens, running, strict=True)):
            if not live or self.ends[row] is not None:
                continue
            self.rows[row].append(int(token))
            if self._completes(row):
                self.ends[row] = len(self.rows[row]) - self.prompt_len[row]
                hits.append(row)
        return hits

    def _completes(self, row: int) -> bool:
        ids, p = self.rows[row], self.prompt_len[row]
        start = max(p - 1, len(ids) - self.window, 0)  # one prompt token of context, or the last `window` tokens
        text, before = self._decode(ids[start:]), self._decode(ids[start:-1])
        response_from = len(self._decode(ids[start:p])) if start < p else 0  # where the response text begins
        new_chars = len(text) - len(before)
        if new_chars <= 0:
            return False
        return any(text.find(s, max(response_from, len(text) - new_chars - len(s) + 1)) != -1 for s in self.stop)
