"""Multi-turn episodes on the chat template: an environment's reply becomes a chat message, rendered incrementally.

Consumes: the policy tokenizer (a Hugging Face tokenizer with a chat template, or a template text overriding it,
``data.chat_template``), the template's extra variables (``data.chat_template_kwargs``), the conversation so far
(``Prompt.messages`` plus the turns played), the policy turn just sampled (its decoded text and whether it ended
with the tokenizer's end-of-turn token) and the environment's reply as a message (``user`` or ``tool``).
Produces: the token ids to append after the policy's own tokens: the rest of the assistant turn's closing that the
policy did not sample, the reply message, and the template's generation prompt for the next assistant turn.

How, for a conversation ``C``, a policy turn with text ``a`` and a reply message ``m``::

    A = render(C + [assistant: a],      add_generation_prompt=False)   ... <|im_start|>assistant\\n a <|im_end|>\\n
    B = render(C + [assistant: a, m],   add_generation_prompt=True)    ... <|im_end|>\\n<|im_start|>user\\n...
    closing = what the template writes after an assistant's text                     "<|im_end|>\\n"
    appended = closing less the end-of-turn token the policy sampled  +  B[len(A):]

Guarantees:
- The policy's tokens are never re-tokenised: only the template text around them is tokenised (without special
  tokens added), so the rollout holds exactly the ids the policy sampled and was conditioned on.
- For a template that only appends (``B`` starts with ``A``) and whose closing starts with the end-of-turn token,
  the rollout's ids equal the tokenisation of the template's rendering of the whole conversation (tested for a
  ChatML template), and the policy mask covers exactly the assistant tokens.
- A template that rewrites earlier turns when one is added (Qwen3-style templates strip ``<think>`` from past
  assistant turns), or that transforms the assistant's text so it no longer appears verbatim, raises
  :class:`TemplateDriftError` naming what differs and what to do: training on such a rollout would use tokens the
  policy never conditioned on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

REPLY_ROLES = ("user", "tool")
"""The roles an environment's reply may take in the conversation."""


class TemplateDriftError(ValueError):
    """The chat template does not render a conversation incrementally; multi-turn rollouts on it are refused."""


@dataclass(frozen=True)
class ChatTurns:
    """Renders environment replies for one tokenizer and template (see the module docstring)."""

    tokenizer: Any
    template: str | None = None  # None: the tokenizer's own chat template
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def render(self, messages: Sequence[Mapping[str, str]], *, generation_prompt: bool) -> str:
        """The template's text for ``messages`` (``add_generation_prompt`` = ``generation_prompt``)."""
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=generation_prompt,
            chat_template=self.template, **dict(self.template_kwargs))

    def reply_tokens(self, conversation: Sequence[Mapping[str, str]], policy_text: str, policy_ended: bool,
                     reply: Mapping[str, str]) -> list[int]:
        """Ids to append after a policy turn (``policy_ended``: its last token was the end-of-turn token)."""
        if reply.get("role") not in REPLY_ROLES:
            raise ValueError(f"an environment reply's role must be one of {', '.join(REPLY_ROLES)}, got "
                             f"{reply.get('role')!r}")
        with_turn = [*conversation, {"role": "assistant", "content": policy_text}]
        before = self.render(with_turn, generation_prompt=False)
        after = self.render([*with_turn, dict(reply)], generation_prompt=True)
        if not after.startswith(before):
            at = next((i for i, (x, y) in enumerate(zip(before, after, strict=False)) if x != y), len(before))
            raise TemplateDriftError(
                f"the chat template rewrites the conversation when a turn is added (first difference at character "
                f"{at} of {len(before)}; Qwen3-style templates strip <think> from past assistant turns): a "
                f"multi-turn rollout would train on tokens the policy never conditioned on. Set data.chat_template "
                f"to a template that only appends turns, or use single-turn rollouts")
        closing = self._closing(conversation, before, policy_text)
        eot = self._end_of_turn()
        if policy_ended and eot and closing.startswith(eot):
            closing = closing[len(eot):]
        text = closing + after[len(before):]
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _closing(self, conversation: Sequence[Mapping[str, str]], rendered: str, policy_text: str) -> str:
        """What the template writes after the assistant's text (its end-of-turn marker and separator), learnt
        from a rendering with a marker as the assistant's content."""
        marker = "\x00stream-rl-assistant-end\x00"
        probe = self.render([*conversation, {"role": "assistant", "content": marker}], generation_prompt=False)
        closing = probe.rsplit(marker, 1)[-1] if marker in probe else None
        if closing is None or not rendered.endswith(policy_text + closing):
            raise TemplateDriftError(
                "the chat template does not write the assistant's text verbatim (it strips or rewrites it), so "
                "the policy's tokens cannot be kept as sampled; set data.chat_template to a template that writes "
                "assistant content as is, or use single-turn rollouts")
        return closing

    def _end_of_turn(self) -> str | None:
        """The text of the token that ends the policy's turn (the tokenizer's eos token)."""
        token = getattr(self.tokenizer, "eos_token", None)
        return token if isinstance(token, str) and token else None
