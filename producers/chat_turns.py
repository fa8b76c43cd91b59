"""Multi-turn episodes on the chat template: an environment's reply becomes a chat message, rendered incrementally.

Consumes: the policy tokenizer (a Hugging Face tokenizer with a chat template, or a template text overriding it,
``data.chat_template``), the template's extra variables (``data.chat_template_kwargs``), the conversation so far
(``Prompt.messages`` plus the turns played), the policy turn just sampled (its decoded text and whether its last
token is the template's end-of-turn token) and the environment's reply as a message (``user`` or ``tool``).
Produces: the token ids to append after the policy's own tokens: the rest of the assistant turn's closing that the
policy did not sample, the reply message, and the template's generation prompt for the next assistant turn; the
template's end-of-turn token (:meth:`ChatTurns.end_of_turn`); and :meth:`ChatTurns.check`, the refusal of a
conversation the template cannot continue (or a prompt whose ids are not its rendering), before anything is
generated.

How, for a conversation ``C``, a policy turn with text ``a`` and a reply message ``m``::

    P = render(C,                       add_generation_prompt=True)    ... <|im_start|>assistant\\n
    A = render(C + [assistant: a],      add_generation_prompt=False)   ... <|im_start|>assistant\\n a <|im_end|>\\n
    B = render(C + [assistant: a, m],   add_generation_prompt=True)    ... <|im_end|>\\n<|im_start|>user\\n...
    closing = what the template writes after an assistant's text                     "<|im_end|>\\n"
    end of turn = the special token the closing starts with                          "<|im_end|>"
    checked:  A == P + a + closing   and   B starts with A
    appended = closing less the end-of-turn token the policy sampled  +  B[len(A):]

``P`` is what the policy was conditioned on (the rollout so far, by induction: the prompt is ``render(C, True)``
and every reply makes the rollout ``B``, the next turn's ``P``), so the two checks make the rollout, after any
number of turns, exactly the template's rendering of the conversation it played.

Guarantees:
- The policy's tokens are never re-tokenised: only the template text around them is tokenised (without special
  tokens added), so the rollout holds exactly the ids the policy sampled and was conditioned on.
- A multi-turn rollout's ids are the tokenisation of the template's rendering of its conversation (the last turn
  up to its end-of-turn token), and the policy mask covers exactly the assistant tokens; else the conversation is
  refused with :class:`TemplateDriftError` naming the true reason and the differing text: the generation prompt
  adds text the rendering of the assistant turn lacks (DeepSeek-R1's ``<think>\\n``); the template writes text
  between the generation prompt and the assistant's text, or does not write the text verbatim (it trims or
  rewrites it); it moves or rewrites an earlier message when a turn is added (Mistral v0.3's system message,
  Qwen3's ``<think>`` stripping); it ends a conversation with text it drops when a turn follows (Phi-3.5's eos).
- :meth:`check` refuses a conversation up front when no probe turn passes the checks (a drift that does not
  depend on the policy's text), or when the prompt's ids are not ``render(C, True)`` tokenised (a prompt
  published with another template or variables, or with tools, which ``Prompt.messages`` does not carry); what
  depends on the text is checked again at every reply.
- The end-of-turn token is learnt from the template, not assumed to be the eos token (Gemma's ``<end_of_turn>``,
  Phi's ``<|end|>``); a policy turn that ends with it does not get it appended a second time.
- The checks compare texts: the policy's turn is its ids decoded on their own (``skip_special_tokens``), so a
  tokenizer whose decoding of a turn differs from the text those ids add in context (SentencePiece drops the
  leading space of a first ``\\u2581word`` token) can make a faithful turn look like drift; a special token the
  policy samples inside a turn is in the rollout but not in its text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

REPLY_ROLES = ("user", "tool")
"""The roles an environment's reply may take in the conversation."""

PROBE_TURNS = ("x", " x")
"""Assistant texts :meth:`ChatTurns.check` renders; a conversation passes when one of them does (a template that
trims the text and writes a space before it, as Mistral's, only takes texts with a leading space)."""
PROBE_REPLY = {"role": "user", "content": "y"}
_MARKER = "\x00stream-rl-assistant-end\x00"
_SHOW = 24  # characters of differing text an error shows
_REMEDY = ("set data.chat_template to a template that only appends turns and writes the assistant's text "
           "verbatim, or use single-turn rollouts")


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

    def check(self, conversation: Sequence[Mapping[str, str]], prompt_ids: Sequence[int] | None = None) -> None:
        """Raise :class:`TemplateDriftError` when no probe turn after ``conversation`` renders as the rollout would
        hold it (the first probe's reason: multi-turn episodes on this conversation can never be faithful), or when
        ``prompt_ids`` (the prompt's published ids) are not this template's rendering of ``conversation``."""
        errors = []
        for text in PROBE_TURNS:
            try:
                self._continuation(conversation, text, PROBE_REPLY)
                break
            except TemplateDriftError as exc:
                errors.append(exc)
            except Exception as exc:  # noqa: BLE001 - a template raising (raise_exception) on the probe
                raise TemplateDriftError(f"the chat template cannot render an assistant turn and a user reply after "
                                         f"this conversation ({type(exc).__name__}: {exc})") from exc
        else:
            raise errors[0]
        if prompt_ids is not None and list(prompt_ids) != self._ids(self.render(conversation, generation_prompt=True)):
            raise TemplateDriftError(
                "the prompt's token ids are not this template's rendering of its messages (it was published with "
                "another template or template variables, or with tools, which Prompt.messages does not carry): the "
                "replies would continue a conversation the policy did not see; publish the prompts with the "
                "producer's data.chat_template and data.chat_template_kwargs")

    def end_of_turn(self, conversation: Sequence[Mapping[str, str]]) -> tuple[str, int] | None:
        """The template's end-of-turn token after an assistant turn following ``conversation``, as (text, id): the
        special token its closing starts with (``<|im_end|>``, ``<end_of_turn>``, ``<|end|>``, ``</s>``); None when
        the closing does not start with one."""
        return self._first_special(self._closing(conversation))

    def reply_tokens(self, conversation: Sequence[Mapping[str, str]], policy_text: str, policy_ended: bool,
                     reply: Mapping[str, str]) -> list[int]:
        """Ids to append after a policy turn (``policy_ended``: its last token was the template's end-of-turn
        token, :meth:`end_of_turn`)."""
        if reply.get("role") not in REPLY_ROLES:
            raise ValueError(f"an environment reply's role must be one of {', '.join(REPLY_ROLES)}, got "
                             f"{reply.get('role')!r}")
        closing, following = self._continuation(conversation, policy_text, reply)
        eot = self._first_special(closing)
        if policy_ended and eot is not None:
            closing = closing[len(eot[0]):]
        return self._ids(closing + following)

    def _ids(self, text: str) -> list[int]:
        """The ids of template text (no special tokens added: the template writes its own)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _continuation(self, conversation: Sequence[Mapping[str, str]], policy_text: str,
                      reply: Mapping[str, str]) -> tuple[str, str]:
        """(closing, what follows it up to the next generation prompt) after ``policy_text``; raises
        :class:`TemplateDriftError` where the rollout would differ from the template's rendering."""
        with_turn = [*conversation, {"role": "assistant", "content": policy_text}]
        prompt = self.render(conversation, generation_prompt=True)
        closed = self.render(with_turn, generation_prompt=False)
        closing = self._closing(conversation)
        if closed != prompt + policy_text + closing:
            raise TemplateDriftError(self._turn_drift(conversation, prompt, policy_text, closing, closed))
        after = self.render([*with_turn, dict(reply)], generation_prompt=True)
        if not after.startswith(closed):
            raise TemplateDriftError(self._append_drift(closed, after, len(prompt) + len(policy_text)))
        return closing, after[len(closed):]

    def _closing(self, conversation: Sequence[Mapping[str, str]]) -> str:
        """What the template writes after an assistant's text (its end-of-turn marker and separator), learnt
        from a rendering with a marker as the assistant's content."""
        probe = self.render([*conversation, {"role": "assistant", "content": _MARKER}], generation_prompt=False)
        if _MARKER not in probe:
            raise TemplateDriftError(f"the chat template does not write the assistant's text verbatim (a probe "
                                     f"turn's text is missing from its rendering); {_REMEDY}")
        return probe.rsplit(_MARKER, 1)[-1]

    def _turn_drift(self, conversation: Sequence[Mapping[str, str]], prompt: str, text: str, closing: str,
                    closed: str) -> str:
        """Why the rendering with the assistant turn (``closed``) is not ``prompt + text + closing``."""
        held = prompt + text + closing
        at = self._diverge(held, closed)
        if at < len(prompt):
            start = self._diverge(self.render(conversation, generation_prompt=False), prompt)
            if at >= start:  # inside the generation prompt itself
                return (f"the generation prompt adds {_show(prompt[at:])} that the template's rendering of the "
                        f"assistant turn does not contain (DeepSeek-R1-style: it writes {_show(closed[at:])} "
                        f"there); the policy would be trained on a conversation the template never writes; "
                        f"{_REMEDY}")
            return _moved(at, held, closed)
        written = closed[len(prompt):]
        if text and text in written and not written.startswith(text):
            return (f"the template writes {_show(written[:written.index(text)])} between the generation prompt "
                    f"and the assistant's text, which the rollout does not contain (Mistral-style); {_REMEDY}")
        if not written.startswith(text):
            return (f"the chat template does not write the assistant's text verbatim (it strips or rewrites it: "
                    f"{_show(text)} is written as {_show(written)}); {_REMEDY}")
        return (f"the template closes this assistant turn with {_show(written[len(text):])}, not with its usual "
                f"closing {_show(closing)}; {_REMEDY}")

    def _append_drift(self, closed: str, after: str, text_end: int) -> str:
        """Why the rendering with a reply (``after``) does not extend the one without it (``closed``)."""
        at = self._diverge(closed, after)
        if at >= text_end:  # inside the closing: text the template writes only at the end of a conversation
            eos = getattr(self.tokenizer, "eos_token", None)
            style = " (Phi-3.5-style: an eos after the last turn)" if eos and eos in closed[at:] else ""
            return (f"the template ends a conversation without a generation prompt with {_show(closed[at:])}"
                    f"{style}, which it drops when a turn follows; a rollout cannot hold both; {_REMEDY}")
        return _moved(at, closed, after)

    def _first_special(self, closing: str) -> tuple[str, int] | None:
        """(text, id) of the special token ``closing`` starts with, or None."""
        ids = self._ids(closing) if closing else []
        if not ids or ids[0] not in _special_ids(self.tokenizer):
            return None
        token = self.tokenizer.convert_ids_to_tokens(ids[0])
        return (token, ids[0]) if isinstance(token, str) and closing.startswith(token) else None

    def _diverge(self, a: str, b: str) -> int:
        """Where ``a`` and ``b`` first differ, moved back to the start of a special token it falls inside."""
        at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        for token in _special_texts(self.tokenizer):
            start = a.rfind(token, 0, at + len(token) - 1)  # the last one starting before ``at``
            if start != -1 and start < at < start + len(token):
                at = start
        return at


def _moved(at: int, before: str, after: str) -> str:
    return (f"the template moves or rewrites an earlier message when a turn is added (first difference at "
            f"character {at}: {_show(before[at:])} becomes {_show(after[at:])}; Mistral v0.3 moves the system "
            f"message to the last user turn, Qwen3 strips <think> from past assistant turns): a multi-turn "
            f"rollout would train on tokens the policy never conditioned on; {_REMEDY}")


def _show(text: str) -> str:
    """A short repr of ``text`` for an error message."""
    return repr(text if len(text) <= _SHOW else text[:_SHOW] + "...")


def _special_texts(tokenizer: Any) -> set[str]:
    """The texts of the tokenizer's special tokens."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    named = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    return named | {getattr(t, "content", str(t)) for t in added.values() if getattr(t, "special", False)}


def _special_ids(tokenizer: Any) -> set[int]:
    """The ids of the tokenizer's special tokens (named ones and added tokens marked special)."""
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return ids | {i for i, token in added.items() if getattr(token, "special", False)}
