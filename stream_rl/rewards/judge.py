"""LLM as a judge: a reward from an OpenAI-compatible chat-completions server (standard library HTTP).

Consumes: :class:`~stream_rl.rewards.settings.JudgeSettings` (declared once there; ``scorer.judge`` is one: base
URL, model, prompt template, score pattern or parser, API-key environment variable, sampling, redaction), the
exchange's deadline (``timeout_s``: the scorer passes ``scorer.reward_timeout_s``) and, per rollout, the prompt,
response and reference answer.
Produces: :class:`JudgeReward`, a per-rollout reward function (the contract of
:mod:`stream_rl.rewards.contract`) that :class:`stream_rl.rewards.calls.RewardCaller` runs with its deadline,
concurrency and retries.

One call per rollout::

    POST {base_url}/chat/completions
    {"model": model, "messages": [{"role": "system", "content": system}?,
                                  {"role": "user", "content": template.format(prompt=, response=, reference=)}],
     "max_tokens": max_tokens, "temperature": temperature, **extra_body}
    score = parser(choices[0].message.content)

The default parser takes the LAST match of ``score_pattern`` (one group, a number); ``parser`` (a
``module:function`` reference, ``text -> float``, raising ValueError on nonsense) replaces it.
Guarantees:
- The template may use ``{prompt}``, ``{response}`` and ``{reference}`` only (checked when built; ``{{``/``}}``
  for literal braces); ``{reference}`` of a rollout without an answer is refused for that rollout.
- Calls go through the transport of :mod:`stream_rl.rewards.http` (one deadline for the whole exchange, answers
  capped at 16 MiB, same-origin redirects only): transport failures and 5xx/429 answers raise the retriable
  :class:`stream_rl.rewards.http.HttpRewardError`; an answer that is not a chat completion, or whose text has no
  finite score, raises :class:`JudgeError` (not retriable): the scorer dead-letters the rollout. Its reason holds
  the judge's text only when ``show_text`` is set, else ``<judge text redacted: N chars>``. The API key (from
  ``api_key_env``) is sent as ``Authorization: Bearer`` to the configured origin only (a redirect to another
  host is refused, not followed) and never appears in a reason.
"""

from __future__ import annotations

import json
import math
import re
import ssl
from collections.abc import Callable, Mapping
from typing import Any

from stream_rl.rewards.http import headers_from_env, loads_json, safe_url, send
from stream_rl.rewards.settings import DEFAULT_PATTERN, JudgeSettings, check_template  # declared there once


class JudgeError(ValueError):
    """The judge's answer could not be turned into a score; ``str()`` is the reason (text redacted by default)."""

    retriable = False


def pattern_parser(pattern: str) -> Callable[[str], float]:
    """A parser taking the last match of ``pattern`` (its first group) as a float; ValueError when none."""
    regex = re.compile(pattern)
    if regex.groups < 1:
        raise ValueError(f"scorer.judge.score_pattern {pattern!r} needs one group around the number")

    def parse(text: str) -> float:
        matches = list(regex.finditer(text))
        if not matches:
            raise ValueError(f"no match of {pattern!r}")
        return float(matches[-1].group(1))

    return parse


class JudgeReward:
    """``fn(prompt, response, answer, metadata) -> float``: the judge's score of one response."""

    def __init__(self, settings: JudgeSettings, *, timeout_s: float = 60.0,
                 extra_body: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
                 tls_context: ssl.SSLContext | None = None) -> None:
        self.settings = settings
        self.timeout_s = timeout_s  # the whole exchange's deadline (the scorer's: scorer.reward_timeout_s)
        self.extra_body = dict(extra_body or {})  # more request fields (a server's own sampling options)
        self.template = check_template(settings.template)
        self.parse = self._parser(settings)
        self.url = settings.base_url.rstrip("/") + "/chat/completions"
        self.where = f"judge {safe_url(self.url)}"
        auth = {"Authorization": settings.api_key_env} if settings.api_key_env else {}
        secret = headers_from_env(auth, environ)
        self._headers = {"Content-Type": "application/json",
                         **({"Authorization": f"Bearer {secret['Authorization']}"} if secret else {})}
        self._tls = tls_context or ssl.create_default_context()
        self.__qualname__ = self.where

    @staticmethod
    def _parser(settings: JudgeSettings) -> Callable[[str], float]:
        if settings.parser is None:
            return pattern_parser(settings.score_pattern)
        from stream_rl.runtime.references import resolve_reference

        fn = resolve_reference(settings.parser, what="scorer.judge.parser", error=ValueError, attr_label="function")
        if not callable(fn):
            raise ValueError(f"scorer.judge.parser {settings.parser!r} is not callable")
        return fn

    def messages(self, prompt: str, response: str, answer: str | None) -> list[dict[str, str]]:
        if answer is None and "{reference" in self.template:
            raise JudgeError("the judge template needs the reference answer, and the rollout has none")
        user = self.template.format(prompt=prompt, response=response, reference=answer or "")
        system = [{"role": "system", "content": self.settings.system}] if self.settings.system else []
        return [*system, {"role": "user", "content": user}]

    def __call__(self, prompt: str, response: str, answer: str | None, metadata: dict[str, str]) -> float:
        s = self.settings
        body = {"model": s.model, "messages": self.messages(prompt, response, answer), "max_tokens": s.max_tokens,
                "temperature": s.temperature, **self.extra_body}
        answer = send(self.url, json.dumps(body).encode(), self._headers, timeout_s=self.timeout_s, tls=self._tls,
                      what=self.where)
        return self.score(completion_text(answer.body, self.where))

    def score(self, text: str) -> float:
        """The parsed, finite score of the judge's ``text``; JudgeError (text redacted unless show_text)."""
        shown = repr(text[:500]) if self.settings.show_text else f"<judge text redacted: {len(text)} chars>"
        try:
            value = float(self.parse(text))
        except (ValueError, TypeError, OverflowError) as exc:  # a parser's nonsense, or a score beyond a float
            raise JudgeError(f"{self.where}: cannot parse a score ({type(exc).__name__}: {exc}) from {shown}") from None
        if not math.isfinite(value):
            raise JudgeError(f"{self.where}: non-finite score {value} from {shown}")
        return value


def completion_text(raw: bytes, where: str) -> str:
    """``choices[0].message.content`` of a chat-completions answer; JudgeError when it is not one."""
    try:
        content = loads_json(raw)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise JudgeError(f"{where} answered something that is not a chat completion ({len(raw)} bytes)") from None
    if not isinstance(content, str):
        raise JudgeError(f"{where} answered a chat completion without text content")
    return content


__all__ = ["DEFAULT_PATTERN", "JudgeError", "JudgeReward", "JudgeSettings", "check_template",
           "completion_text", "pattern_parser"]
