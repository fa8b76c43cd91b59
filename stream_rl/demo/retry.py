"""The demo's multi-turn task: two-digit addition with a second try after a hint.

Consumes: addition prompts (:mod:`stream_rl.demo.task`). Produces: an environment for ``producer.environment``
(:class:`RetryAddition`) and the reward for ``scorer.reward_fn`` (:func:`retry_reward`).

Guarantees:
- ``RetryAddition`` ends the episode at the first correct answer. After a wrong one it replies with the hint
  ``d=``, the last digit of the correct sum followed by ``=`` (characters of the demo's tokenizer), and the policy
  answers again; ``producer.max_turns`` bounds the tries.
- ``retry_reward`` reads the turns from the rollout's ``response_text`` (turns joined by newlines, policy turns at
  even positions) and pays ``2 ** -k`` when policy turn ``k`` (0-based) is the first correct answer, 0 when none
  is: a first-try answer is worth 1, a second-try one 0.5.
- Both are pure and need nothing from the roles: the environment returns plain strings.
"""

from __future__ import annotations

from stream_rl.demo.task import addition_reward, answer_for

ENVIRONMENT = "stream_rl.demo.retry:RetryAddition"
REWARD_FUNCTION = "stream_rl.demo.retry:retry_reward"


class RetryAddition:
    """Replies ``d=`` (the sum's last digit) to a wrong answer; ``None`` (the end) to a correct one."""

    def __init__(self) -> None:
        self.answer = ""

    def reset(self, prompt) -> None:
        self.answer = prompt.answer if prompt.answer is not None else answer_for(prompt.text)

    def step(self, policy_text: str) -> str | None:
        if addition_reward("", policy_text, self.answer, {}) == 1.0:
            return None
        return f"{self.answer[-1]}="


def retry_reward(prompt: str, response: str, answer: str | None, metadata: dict) -> float:
    """``2 ** -k`` for the first correct policy turn ``k`` of ``response`` (turns joined by newlines), else 0."""
    expected = answer if answer is not None else answer_for(prompt)
    for k, text in enumerate(response.split("\n")[::2]):
        if addition_reward(prompt, text, expected, metadata) == 1.0:
            return 2.0 ** -k
    return 0.0
