"""Built-in verifiers: pull a final answer out of a response and compare it with the reference answer.

Consumes: a response text (what the policy wrote, of any length and content) and a reference answer (the dataset's
ground truth).
Produces: for each verifier, ``extract(text) -> str | None`` (the canonical answer found, None when there is none)
and ``score(response, answer) -> float`` (1.0 when the extracted answer equals the reference's, else 0.0); the
registry :data:`VERIFIERS` by short name (``gsm8k``, ``math_boxed``, ``multiple_choice``), each also callable as a
reward function (``Verifier.reward``, the contract of :mod:`stream_rl.rewards.contract`).
Guarantees: pure; linear time in the text (a scan with ``str`` methods, one-pass brace matching, regexes that are
literals, character classes, or run on a bounded window; no regex can backtrack over an unbounded span: a
degenerate output of 100,000 characters costs milliseconds, and no call holds the GIL for long); the reference
answer goes through the same parser as the response (a verl ground truth ``72`` and a raw GSM8K solution ending
in ``#### 72`` both work); a reference answer that is missing or has no answer in it raises ``ValueError`` naming
it (the scorer dead-letters that rollout, no reward is guessed). Trailing end-of-sequence / padding markers
(``<eos>``, ``</s>``, ``<|endoftext|>``, ``<|im_end|>``, ``<pad>``) and whitespace are ignored.

The exact rules (docs/rewards.md repeats them):

``gsm8k``
    The first number after the last ``####`` (or, when the text after it has no number, the English number words
    it starts with: ``#### thirty-five`` -> ``35``); without ``####``, the number right after the last "answer is" /
    "answer:" (``answer`` in any case; ``**``, ``$`` and spaces may come between: ``The answer is: **$1,200**``),
    else the last number of the response. A number is an optional sign (``-``, ``+``,
    ``−``, only where it is not glued to a word or digit before it: ``3-4`` is ``3`` and ``4``), an optional
    ``$`` (at most one space on each side), ASCII digits with optional thousands commas (a first group of 1-3
    digits, then groups of exactly 3: ``1,234``; in ``1,2`` or ``1,234,56`` every comma separates numbers) and an
    optional decimal part (``.5`` too). Digits glued to a word or a ``.`` before them (``x2``, ``v1.2.3``'s
    ``2``) are not a number; a number of more than 100 characters is not a number (degenerate output).
    Canonical form: commas and ``$`` dropped, exact decimal value without trailing zeros (``3.50`` -> ``3.5``,
    ``4.0`` -> ``4``, ``-0`` -> ``0``). Trailing units and words are ignored (``42 apples`` -> ``42``).
``math_boxed``
    The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) whose braces balance (nested braces too;
    ``\\boxed 5`` too), normalised (:func:`~stream_rl.rewards.math_equal.normalize_math`): ``\\$``, ``$``,
    ``\\left``/``\\right``, ``\\displaystyle``/``\\textstyle``, ``\\!``/``\\,``/``\\;``/``\\:``/``\\>``/``\\ ``,
    ``\\quad``/``\\qquad``, ``~`` and spaces dropped (one space kept between a command and a letter:
    ``\\pi r``); ``{,}`` -> ``,``; degrees (``^\\circ``, ``^{\\circ}``, ``°``), ``\\%``/``%`` and a trailing ``.``
    dropped; a trailing ``\\text{...}``/``\\mbox{...}``/``\\mathrm{...}`` unit after something else dropped, with
    an optional power (``5\\text{ cm}^2`` -> ``5``); other ``\\text``, ``\\textrm``, ``\\textbf``, ``\\mbox``,
    ``\\mathrm``, ``\\mathbf``, ``\\boldsymbol`` wrappers unwrapped; ``\\dfrac``/``\\tfrac`` -> ``\\frac``,
    ``\\frac12`` -> ``\\frac{1}{2}``, ``\\sqrt2`` -> ``\\sqrt{2}``; ``x=5`` -> ``5`` (one ``=`` with a one-letter
    left side); thousands commas in a plain number dropped; a letter in parentheses ``(C)`` -> ``C``. Two answers
    are equal when (1) their normalised strings are equal; else (2) when both are rational numbers (an integer, a
    decimal, ``a/b`` or ``\\frac{a}{b}`` with integer ``a``, ``b`` and an optional sign, in front or on ``a``):
    exactly when their values are equal (``\\frac{1}{2}`` = ``1/2`` = ``0.5``; ``0.333`` != ``\\frac{1}{3}``, no
    tolerance); else (3) when either is a plain word (``Paris``): the words compared case-blind; else (4) when
    HF math-verify (sympy) says the response's answer equals the reference's (``\\frac{\\sqrt2}{2}`` =
    ``\\sqrt{2}/2``, ``2\\sqrt2`` = ``\\sqrt8``, ``(x+1)^2`` = ``x^2+2x+1``, ``\\{1,2\\}`` = ``\\{2,1\\}``,
    ``x\\in[2,5)`` = ``[2,5)``), asked only of answers that pass
    :func:`~stream_rl.rewards.math_equal.bounded_for_math_verify` (at most 128 characters, allowlisted commands,
    no factorial or power tower: its cost is bounded); other pairs are unequal.
``multiple_choice``
    A letter A-E, found by the first rule that matches: (1) the last "answer is X" / "answer: X" / "answer is: X"
    / "answer is... X" (``answer`` in any case, then ``is`` and/or ``:``; at most 8 spaces between the parts; an
    optional ``option``/``choice`` word; X upper case, optionally in ``()``, ``[]``, ``**`` or ``__``, not followed
    by a letter or digit; a lower-case x only in
    brackets or followed by the end, ``.``, ``,``, ``;`` or ``)``: "the answer is a number" and "Answer C is a
    distractor" find nothing); (2) the last ``\\boxed{X}`` (``\\boxed{\\text{(B)}}`` too); (3) the response
    starts with the letter as its own token, optionally after ``Option``/``Choice``: ``C``, ``C.``, ``C)``,
    ``(C)``, ``**C**``, ``C: Paris``, ``Option C`` (upper case; lower case only when it is the whole response),
    not ``A dog ...``. Canonical form: the upper-case
    letter.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal

from stream_rl.rewards.math_equal import last_boxed, math_equal, normalize_math

__all__ = ["VERIFIERS", "Verifier", "canonical_number", "gsm8k_extract", "last_boxed", "math_boxed_extract",
           "math_equal", "multiple_choice_extract", "normalize_math", "strip_response"]

_END_MARKERS = ("<eos>", "</s>", "<|endoftext|>", "<|im_end|>", "<pad>")


def strip_response(response: str) -> str:
    """``response`` without trailing end/padding markers and surrounding whitespace (one backward scan)."""
    end = len(response)
    while True:
        while end and response[end - 1].isspace():
            end -= 1
        marker = next((m for m in _END_MARKERS if response.endswith(m, 0, end)), None)
        if marker is None:
            return response[:end].lstrip()
        end -= len(marker)


# --- gsm8k ----------------------------------------------------------------------------------------------------

_RUN = re.compile(r"[0-9.,]+")
_ANSWER = re.compile(r"answer", re.IGNORECASE)
_DIGIT_RUN = re.compile(r"[0-9]*")
_DIGITS = frozenset("0123456789")
_SIGNS = ("-", "+", "\u2212")
_MAX_NUMBER_CHARS = 100


def canonical_number(sign: str, digits: str) -> str:
    """``("-", "1,234.50")`` -> ``"-1234.5"``: commas dropped, exact value, no trailing zeros, no ``-0``."""
    value = Decimal(digits.replace(",", ""))
    if sign in ("-", "\u2212"):
        value = -value
    return "0" if value == 0 else format(value.normalize(), "f")


def _digits_end(run: str, i: int) -> int:
    return _DIGIT_RUN.match(run, i).end()


def _run_numbers(run: str) -> Iterator[tuple[int, str]]:
    """``(offset, number)`` for each number in ``run``, a maximal run of digits, commas and dots (the
    ``gsm8k`` rule of the module docstring). Each character is visited a bounded number of times."""
    i, n = 0, len(run)
    while i < n:
        if run[i] == "." and (i == 0 or run[i - 1] == ",") and _digits_end(run, i + 1) > i + 1:
            end = _digits_end(run, i + 1)  # ".5"
            yield i, run[i:end]
            i = end
        elif run[i] not in _DIGITS:
            i += 1
        elif i and run[i - 1] == ".":  # "1.2.3": digits glued to a dot are not a number
            i = _digits_end(run, i)
        else:
            i = yield from _number_at(run, i)


def _number_at(run: str, i: int) -> Iterator[tuple[int, str]]:
    """The number(s) that start with the digit ``run[i]``; returns the index after what was consumed."""
    groups, k = [i], _digits_end(run, i)
    while run[k:k + 1] == "," and _digits_end(run, k + 1) > k + 1:
        groups.append(k + 1)
        k = _digits_end(run, k + 1)
    widths = [_digits_end(run, g) - g for g in groups]
    if len(groups) > 1 and (widths[0] > 3 or any(w != 3 for w in widths[1:])):  # "1,2": a list of numbers
        for g, w in zip(groups[:-1], widths[:-1]):
            yield g, run[g:g + w]
        return groups[-1]  # the last group starts a number of its own (it may have decimals)
    if run[k:k + 1] == "." and _digits_end(run, k + 1) > k + 1:
        k = _digits_end(run, k + 1)
    yield i, run[i:k]
    return k


def _sign_before(text: str, start: int) -> str:
    """The sign of the number at ``text[start]``: ``[sign][space][$][space]`` before it, the sign not glued."""
    k = start
    for wanted in (str.isspace, "$".__eq__, str.isspace):
        if k and wanted(text[k - 1]):
            k -= 1
    if k and text[k - 1] in _SIGNS and not (k > 1 and _glued(text[k - 2])):
        return text[k - 1]
    return ""


def _glued(ch: str) -> bool:
    return ch.isalnum() or ch in "_."


def _numbers(text: str, pos: int = 0, endpos: int | None = None) -> Iterator[tuple[int, str, str]]:
    """``(start, sign, digits)`` of each number of ``text[pos:endpos]`` in order (module docstring, ``gsm8k``)."""
    for run in _RUN.finditer(text, pos, len(text) if endpos is None else endpos):
        start = run.start()
        if start and _glued(text[start - 1]):  # "x2": glued to a word
            continue
        for offset, digits in _run_numbers(run.group()):
            if len(digits) <= _MAX_NUMBER_CHARS:
                yield start + offset, (_sign_before(text, start) if offset == 0 else ""), digits


_GSM_ANSWER = re.compile(r"\s{0,8}(?:(?i:is)\b\s{0,8}:?|:)[\s*$]{0,8}[-+\u2212]?")  # after "answer"


def _stated_answer(text: str) -> tuple[int, str, str] | None:
    """The number that directly follows the last "answer is" / "answer:" (``**``, ``$``, spaces between)."""
    for answer in reversed(list(_ANSWER.finditer(text))):
        lead = _GSM_ANSWER.match(text, answer.end(), answer.end() + 32)
        if lead is None:
            continue
        first = next(_numbers(text, lead.end(), lead.end() + _MAX_NUMBER_CHARS + 1), None)
        return first if first is not None and first[0] == lead.end() else None
    return None


_UNITS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen".split())}
_TENS = {w: 10 * i for i, w in enumerate("_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()) if i > 1}
_SCALES = {"hundred": 100, "thousand": 1000, "million": 1_000_000}


def number_words(text: str) -> int | None:
    """The non-negative integer an English number phrase at the start of ``text`` spells (``thirty-five``, ``one
    hundred and five``, ``two thousand``), or None. Bounded by the caller (at most 80 characters are passed)."""
    words = text.lower().replace("-", " ").replace(",", " ").split()
    total = current = 0
    seen = False
    for word in words:
        word = word.strip(".!;:*")
        if word in _UNITS or word in _TENS:
            current += _UNITS.get(word, 0) + _TENS.get(word, 0)
        elif word in _SCALES and seen:
            if _SCALES[word] == 100:
                current *= 100
            else:
                total, current = total + current * _SCALES[word], 0
        elif word == "and" and seen:
            continue
        else:
            break
        seen = True
    return total + current if seen else None


def gsm8k_extract(text: str) -> str | None:
    """The final number of a GSM8K-style answer (module docstring, ``gsm8k``), canonical; None when none."""
    text = strip_response(text)
    head, marker, _ = text.rpartition("####")
    if marker:
        found = next(_numbers(text, len(head) + len(marker)), None)
        if found is None:  # "#### thirty-five": the marker says the words are the answer
            words = number_words(text[len(head) + len(marker):len(head) + len(marker) + 80])
            return None if words is None else str(words)
    else:
        found = _stated_answer(text)
        for found in (_numbers(text) if found is None else ()):
            pass
    return canonical_number(*found[1:]) if found else None


# --- math_boxed -------------------------------------------------------------------------------------------------

def math_boxed_extract(text: str) -> str | None:
    """The normalised content of the last ``\\boxed{}`` of ``text``; None when there is none (or it is empty)."""
    boxed = last_boxed(strip_response(text))
    if boxed is None:
        return None
    return normalize_math(boxed) or None


def _math_reference(answer: str) -> str | None:
    """A reference answer given boxed or bare, normalised."""
    boxed = "\\boxed" in answer or "\\fbox" in answer
    return math_boxed_extract(answer) if boxed else (normalize_math(answer) or None)


# --- multiple_choice ----------------------------------------------------------------------------------------------

_AFTER_ANSWER = re.compile(  # bounded quantifiers only, run on a window of _WINDOW characters
    r"\s{0,8}(?:(?i:is)\b(?:\.{2,3}|\u2026)?\s{0,8}:?|:)\s{0,8}(?:\*\*|__)?\s{0,8}(?:(?i:option|choice)\s{1,8})?"
    r"(?:[(\[]([A-Ea-e])[)\]]|([A-E])(?![A-Za-z0-9])|([a-e])(?=\s{0,8}(?:$|[.,;)])))")
_WINDOW = 96  # > the most _AFTER_ANSWER consumes (about 70): its "$" is the text's end, never the window's
_BOXED_LETTER = re.compile(r"\(?([A-Ea-e])\)?\.?")
_START = re.compile(r"(?:\*\*|__)?\s*(?:(?i:option|choice)\s{1,8})?"
                    r"(?:[(\[]([A-Ea-e])[)\]]|([A-E])(?:\*\*|__)?(?:$|[.):](?!\w)|\s*$))")
_WHOLE_LOWER = re.compile(r"[(\[*_]*([a-e])[)\].*_]*")


def _answer_is(text: str) -> str | None:
    """Rule (1): the letter of the last "answer is X" / "answer: X"."""
    for answer in reversed(list(_ANSWER.finditer(text))):
        found = _AFTER_ANSWER.match(text, answer.end(), answer.end() + _WINDOW)
        if found:
            return "".join(g for g in found.groups() if g)
    return None


def multiple_choice_extract(text: str) -> str | None:
    """The chosen letter A-E (module docstring, ``multiple_choice``), upper case; None when none is found."""
    text = strip_response(text)
    letter = _answer_is(text)
    if letter is None and (boxed := last_boxed(text)) is not None:
        found = _BOXED_LETTER.fullmatch(normalize_math(boxed))
        letter = found.group(1) if found else None
    if letter is None and (start := _START.match(text) or _WHOLE_LOWER.fullmatch(text)):
        letter = next(g for g in start.groups() if g)
    return letter.upper() if letter else None


# --- the registry -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Verifier:
    """A final-answer checker: ``extract`` for the response, ``reference`` for the dataset's answer, ``equal``."""

    name: str
    extract: Callable[[str], str | None]
    reference: Callable[[str], str | None]
    equal: Callable[[str, str], bool] = str.__eq__

    def expected(self, answer: str | None) -> str:
        """The reference answer in canonical form; ValueError when there is none."""
        if answer is None:
            raise ValueError(f"verifier {self.name!r} needs the prompt's reference answer, and the rollout has none")
        expected = self.reference(answer)
        if expected is None:
            raise ValueError(f"verifier {self.name!r} finds no answer in the reference answer {answer[:200]!r}")
        return expected

    def score(self, response: str, answer: str | None) -> float:
        """1.0 when the answer extracted from ``response`` equals the reference's, else 0.0."""
        expected = self.expected(answer)
        got = self.extract(response)
        return 1.0 if got is not None and self.equal(got, expected) else 0.0

    def reward(self, prompt: str, response: str, answer: str | None, metadata: dict[str, str]) -> float:
        """The verifier as a reward function: ``score(response, answer)``."""
        return self.score(response, answer)


VERIFIERS: dict[str, Verifier] = {
    "gsm8k": Verifier("gsm8k", gsm8k_extract, gsm8k_extract),
    "math_boxed": Verifier("math_boxed", math_boxed_extract, _math_reference, math_equal),
    "multiple_choice": Verifier("multiple_choice", multiple_choice_extract, multiple_choice_extract),
}
"""The built-in verifiers by the short names ``scorer.rewards`` accepts in place of a ``module:function``."""
