"""Multi-turn test helpers: a scripted environment (``Scripted``) whose replies and stops are fixed in advance, the
prompt record the multi-turn tests send, and a scripted chat policy (``ScriptedChatEngine``) that writes fixed
turns and stops at the stop tokens it is given, as the real engines do."""

from __future__ import annotations

from producers.engines.base import GenerationEngine, Sample
from schemas import Prompt


class Scripted:
    """Replies ``replies[k]`` after policy turn k (``None``: the end); records what it saw."""

    def __init__(self, replies):
        self.replies, self.seen, self.prompt = list(replies), [], None

    def reset(self, prompt):
        self.prompt = prompt

    def step(self, policy_text):
        self.seen.append(policy_text)
        return self.replies[len(self.seen) - 1] if len(self.seen) <= len(self.replies) else None


def episode_prompt(text="12+34=", answer="46"):
    return Prompt(prompt_id="add-12-34", epoch=0, text=text, answer=answer, group_size=2)


class ScriptedChatEngine(GenerationEngine):
    """Policy turn k of every sample writes the ids of ``turns[k]`` (a text with the tokenizer's special tokens
    written in it), cut after the first stop token (eos or ``Sampling.stop_token_ids``) or at the budget, as the
    engines cut; records each call's ``Sampling``."""

    def __init__(self, tokenizer, turns: list[str]):
        self._tokenizer, self._version, self._eos = tokenizer, 0, tokenizer.eos_token_id
        self.turns, self.samplings = list(turns), []

    max_model_len = property(lambda self: 4096)
    vocab_size = property(lambda self: len(self._tokenizer))

    def generate(self, prompt_token_ids, n, sampling, max_new_tokens, seed):
        self.samplings.append(sampling)
        turn = self.turns[min(len(self.samplings) - 1, len(self.turns) - 1)]
        ids = list(self._tokenizer(turn, add_special_tokens=False)["input_ids"])
        stops = {self._eos, *sampling.stop_token_ids}
        end = next((i + 1 for i, t in enumerate(ids) if t in stops), None)
        ids, reason = (ids[:end], "stop") if end is not None and end <= max_new_tokens else (ids[:max_new_tokens],
                                                                                            "length")
        return [[Sample(ids, [-0.5] * len(ids), reason) for _ in range(n)] for _ in prompt_token_ids]

    def load_weights(self, state_dict, version):
        raise NotImplementedError
