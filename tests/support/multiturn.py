"""Multi-turn test helpers: a scripted environment (``Scripted``) whose replies and stops are fixed in advance, and
the prompt record the multi-turn tests send."""

from __future__ import annotations

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
