"""Built-in verifiers: pull a final answer out of a response and compare it with the reference answer.

Consumes: a response text (what the policy wrote) and a reference answer (the dataset's ground truth).
Produces: for each verifier, ``extract(text) -> str | None`` (the canonical answer found, None when there is none)
and ``score(response, answer) -> float`` (1.0 when the extracted answer equals the reference's, else 0.0); the
registry :data:`VERIFIERS` by short name (``gsm8k``, ``math_boxed``, ``multiple_choice``), each also callable as a
reward function (``Verifier.reward``, the contract of :mod:`stream_rl.rewards.contract`).
Guarantees: pure; the reference answer goes through the same parser as the response (a verl ground truth ``72``
and a raw GSM8K solution ending in ``#### 72`` both work); a reference answer that is missing or has no answer in
it raises ``ValueError`` naming it (the scorer dead-letters that rollout, no reward is guessed). Trailing
end-of-sequence / padding markers (``<eos>``, ``</s>``, ``<|endoftext|>``, ``<|im_end|>``, ``<pad>``) are ignored.

The exact rules (docs/rewards.md repeats them):

``gsm8k``
    The text after the last ``####``, else (no ``####``) the whole response; in it, the first number after
    ``####`` or the last number of a response without ``####``. A number is an optional sign (``-``, ``+``,
    ``−``), an optional ``$``, digits with optional thousands commas (``1,234``; ``1,2`` is two numbers) and an
    optional decimal part. Canonical form: commas and ``$`` dropped, exact decimal value without trailing zeros
    (``3.50`` -> ``3.5``, ``4.0`` -> ``4``, ``-0`` -> ``0``). Trailing units and words are ignored
    (``42 apples`` -> ``42``).
``math_boxed``
    The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, nested braces balanced; ``\\boxed 5`` too),
    normalised (:func:`normalize_math`): spaces, ``\\left``/``\\right``, ``\\!``/``\\,``/``\\;``/``\\:``, ``$``, a
    trailing ``.``, degrees (``^\\circ``, ``^{\\circ}``, ``°``), ``\\%``/``%`` and a trailing ``\\text{...}`` unit
    dropped; other ``\\text{x}``/``\\mathrm{x}``/``\\textbf{x}``/``\\mbox{x}`` unwrapped; ``\\dfrac``/``\\tfrac`` ->
    ``\\frac``, ``\\frac12`` -> ``\\frac{1}{2}``, ``\\sqrt2`` -> ``\\sqrt{2}``; ``x=5`` -> ``5`` (one ``=`` with a
    one-letter left side); thousands commas in a plain integer dropped. Two answers are equal when their
    normalised strings are equal, or when both are rational numbers (an integer, a decimal, ``a/b`` or
    ``\\frac{a}{b}`` with integer ``a``, ``b`` and an optional sign) of exactly the same value: ``\\frac{1}{2}`` =
    ``\\dfrac12`` = ``1/2`` = ``0.5``, but ``0.333`` != ``\\frac{1}{3}`` (no tolerance).
``multiple_choice``
    A letter A-E, found by the first rule that matches: (1) the last "answer is X" / "answer: X" (``answer`` in any
    case; X upper case, optionally in ``()``, ``[]`` or ``**``; a lower-case x only in brackets or followed by
    the end, ``.``, ``,``, ``;`` or ``)``: "the answer is a number" finds nothing); (2) the last ``\\boxed{X}``;
    (3) the response starts with the letter as its own token: ``C``, ``C.``, ``C)``, ``(C)``, ``**C**``,
    ``C: Paris`` (upper case; lower case only when it is the whole response), not ``A dog ...``. Canonical form:
    the upper-case letter.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction

_TRAILING_MARKERS = re.compile(r"(?:<eos>|</s>|<\|endoftext\|>|<\|im_end\|>|<pad>|\s)+$")


def strip_response(response: str) -> str:
    """``response`` without trailing end/padding markers and surrounding whitespace."""
    return _TRAILING_MARKERS.sub("", response).strip()


# --- gsm8k ----------------------------------------------------------------------------------------------------

_GSM_NUMBER = re.compile(r"(?<![\w.])([-+\u2212]?)\s?\$?\s?((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?![\d,]\d)")


def canonical_number(sign: str, digits: str) -> str:
    """``("-", "1,234.50")`` -> ``"-1234.5"``: commas dropped, exact value, no trailing zeros, no ``-0``."""
    value = Decimal(digits.replace(",", ""))
    if sign in ("-", "\u2212"):
        value = -value
    return "0" if value == 0 else format(value.normalize(), "f")


def gsm8k_extract(text: str) -> str | None:
    """The final number of a GSM8K-style answer (module docstring, ``gsm8k``), canonical; None when none."""
    text = strip_response(text)
    _, marker, tail = text.rpartition("####")
    numbers = _GSM_NUMBER.findall(tail if marker else text)
    if not numbers:
        return None
    sign, digits = numbers[0] if marker else numbers[-1]
    return canonical_number(sign, digits)


# --- math_boxed -------------------------------------------------------------------------------------------------

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """The content of the balanced ``{...}`` opening at ``text[start]`` and the index after it; None: unbalanced."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i], i + 1
    return None


def last_boxed(text: str) -> str | None:
    """The raw content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed X``), None when none."""
    for match in reversed(list(_BOXED.finditer(text))):
        end = match.end()
        if end < len(text) and text[end] == "{":
            found = _braced(text, end)
            if found is not None:
                return found[0]
        elif match.group() != match.group().rstrip():  # "\\boxed 5": the next token
            token = re.match(r"[^\s$]+", text[end:])
            if token:
                return token.group()
    return None


def _unwrap(text: str, command: str, keep: bool = True) -> str:
    """Replace every ``\\command{x}`` by ``x`` (or by nothing when ``keep`` is False); braces balanced."""
    out, i, needle = [], 0, "\\" + command + "{"
    while (j := text.find(needle, i)) >= 0:
        found = _braced(text, j + len(needle) - 1)
        if found is None:
            break
        out.append(text[i:j] + (found[0] if keep else ""))
        i = found[1]
    return "".join(out) + text[i:]


_SPACES = re.compile(r"\\[!,;:]|\\ |\\left|\\right|\s|\$")
_DEGREES = re.compile(r"\^\{?\\circ\}?|°|\\%|%")
_FRAC_SHORT = re.compile(r"\\frac(\d)(\d)")
_FRAC_ONE = re.compile(r"\\frac(\d)(\{)|\\frac(\{[^{}]*\})(\d)")
_SQRT_SHORT = re.compile(r"\\sqrt(\w)")
_TRAILING_TEXT = re.compile(r"^(.+?)\\(?:text|mbox|mathrm)\{[^{}]*\}$")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def normalize_math(answer: str) -> str:
    """A LaTeX answer in the canonical form of the module docstring (``math_boxed``)."""
    s = _SPACES.sub("", answer)
    s = _DEGREES.sub("", s).rstrip(".")
    trailing = _TRAILING_TEXT.match(s)
    if trailing:
        s = trailing.group(1)
    for command in ("text", "mbox", "mathrm", "textbf"):
        s = _unwrap(s, command)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_ONE.sub(lambda m: f"\\frac{{{m[1]}}}{m[2]}" if m[1] else f"\\frac{m[3]}{{{m[4]}}}", s)
    s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    if s.count("=") == 1 and re.match(r"^[A-Za-z]=", s):
        s = s[2:]
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    return s.rstrip(".")


_RATIONAL = re.compile(r"^([-+]?)(?:\\frac\{(\d+)\}\{(\d+)\}|(\d+)/(\d+)|(\d+(?:\.\d*)?|\.\d+))$")


def rational_value(normalized: str) -> Fraction | None:
    """The exact value of a normalised answer that is a rational number (``-\\frac{3}{4}``, ``3/4``, ``0.75``)."""
    m = _RATIONAL.match(normalized)
    if m is None:
        return None
    sign, num, den, num2, den2, plain = m.groups()
    try:
        value = Fraction(plain) if plain else Fraction(int(num or num2), int(den or den2))
    except (ZeroDivisionError, ValueError):
        return None
    return -value if sign == "-" else value


def math_equal(a: str, b: str) -> bool:
    """Normalised ``a`` and ``b`` are equal strings, or rationals of exactly the same value."""
    if a == b:
        return True
    va, vb = rational_value(a), rational_value(b)
    return va is not None and va == vb


def math_boxed_extract(text: str) -> str | None:
    """The normalised content of the last ``\\boxed{}`` of ``text``; None when there is none (or it is empty)."""
    boxed = last_boxed(strip_response(text))
    if boxed is None:
        return None
    return normalize_math(boxed) or None


def _math_reference(answer: str) -> str | None:
    """A reference answer given boxed or bare, normalised."""
    return math_boxed_extract(answer) if _BOXED.search(answer) else (normalize_math(answer) or None)


# --- multiple_choice ----------------------------------------------------------------------------------------------

_AFTER_LOWER = r"(?=\s*(?:$|[.,;)]))"
_ANSWER_IS = re.compile(
    r"(?i:answer)\s*(?:(?i:is)\s*)?[:\-]?\s*(?:\*\*|__)?\s*"
    r"(?:[(\[]([A-Ea-e])[)\]]|([A-E])\b|([a-e])" + _AFTER_LOWER + r")")
_START = re.compile(r"^(?:\*\*|__)?\s*(?:[(\[]([A-Ea-e])[)\]]|([A-E])(?:\*\*|__)?(?:$|[.):](?!\w)|\s*$))")
_WHOLE_LOWER = re.compile(r"^[(\[*_]*([a-e])[)\].*_]*$")


def multiple_choice_extract(text: str) -> str | None:
    """The chosen letter A-E (module docstring, ``multiple_choice``), upper case; None when none is found."""
    text = strip_response(text)
    found = _ANSWER_IS.findall(text)
    if found:
        return "".join(found[-1]).upper()
    boxed = last_boxed(text)
    if boxed is not None:
        letter = re.fullmatch(r"\s*(?:\\text\{)?\s*\(?([A-Ea-e])\)?\s*\}?\s*", boxed)
        if letter:
            return letter.group(1).upper()
    start = _START.match(text) or _WHOLE_LOWER.match(text)
    if start:
        return next(g for g in start.groups() if g).upper()
    return None


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
