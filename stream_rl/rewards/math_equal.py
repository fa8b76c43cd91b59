"""Math answers for the ``math_boxed`` verifier: the last ``\\boxed{...}`` of a text, its normal form, and whether
two answers are the same mathematical answer.

Consumes: a response or reference text of any length and content (policy output is adversarial: degenerate
repetitions, unbalanced braces, megabytes of spaces).
Produces: :func:`last_boxed` (the raw content of the last box, None when there is none), :func:`normalize_math`
(the canonical string of an answer), :func:`math_equal` (``got`` vs ``expected``, both canonical).
Guarantees:

- Linear time in the text. Braces are matched for the whole text in one pass (a stack), so a run of 20,000
  unclosed ``\\boxed{`` costs one scan, not one per box; every regex here is a literal, a character class or an
  anchored pattern with no two adjacent quantifiers over the same characters (nothing can backtrack over an
  unbounded span); the unit, wrapper and fraction rewrites each visit a character a bounded number of times.
- :func:`math_equal` asks the cheap rules first (equal canonical strings, or both exact rationals: then their
  values decide, with no tolerance) and HF ``math-verify`` (sympy) only when those say "not equal" and both answers
  pass :func:`bounded_for_math_verify`: at most :data:`MATH_VERIFY_MAX_CHARS` characters, only LaTeX commands of
  an allowlist, no factorial, no power tower, no exponent over :data:`MAX_EXPONENT`, powers that together build
  numbers of at most :data:`MAX_POWER_DIGITS` digits, and, when the answer has variables, at most
  :data:`MATH_VERIFY_MAX_SYMBOLIC_CHARS` characters and no exponent over :data:`MAX_GROUP_EXPONENT` on a
  bracketed group (a symbolic expansion such as ``(a+b+c+d+e+f)^{4}`` costs sympy seconds). math-verify's own
  timeouts use ``signal.alarm``, which works only in the main thread, and the scorer calls rewards on worker
  threads, so they are off; the gate is what bounds its cost (docs/rewards.md has the measured worst case).
  math-verify is imported on first use; it is pure Python, so it yields the GIL to the caller's other threads.
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction
from functools import lru_cache

MATH_VERIFY_MAX_CHARS = 128
"""Longer answers are compared by their canonical strings and rational values only."""
MATH_VERIFY_MAX_SYMBOLIC_CHARS = 48
"""The same bound for answers with variables (``x``, ``a``): sympy expands products of sums."""
MAX_GROUP_EXPONENT = 2
"""The largest integer power of a bracketed group that math-verify expands when the answer has variables."""
MAX_EXPONENT = 99
"""The largest integer exponent math-verify sees (``\\sqrt{999^{999}+1}`` costs sympy 50 s: it factors the
radicand)."""
MAX_POWER_DIGITS = 400
"""The digits all powers of one answer may build together (``99^{99}`` has about 198): bounds sympy's integers."""

_BOX = re.compile(r"\\(?:boxed|fbox)")
_BRACE = re.compile(r"[{}]")
_TOKEN = re.compile(r"[^\s$]+")


def matching_braces(text: str) -> dict[int, int]:
    """The index of the ``}`` that closes each ``{`` of ``text`` (unclosed ones absent): one pass, a stack."""
    stack: list[int] = []
    closing: dict[int, int] = {}
    for brace in _BRACE.finditer(text):
        if brace.group() == "{":
            stack.append(brace.start())
        elif stack:
            closing[stack.pop()] = brace.start()
    return closing


def last_boxed(text: str) -> str | None:
    """The raw content of the last ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces (or ``\\boxed X``)."""
    ends = [box.end() for box in _BOX.finditer(text)]
    if not ends:
        return None
    closing = matching_braces(text)
    for end in reversed(ends):
        i = end
        while i < len(text) and text[i].isspace():  # the runs after two boxes are disjoint: linear in all
            i += 1
        if i < len(text) and text[i] == "{":
            if i in closing:
                return text[i + 1:closing[i]]
        elif i > end:  # "\\boxed 5": the next token
            token = _TOKEN.match(text, i)
            if token:
                return token.group()
    return None


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """The content of the balanced ``{...}`` opening at ``text[start]`` and the index after it; None: unbalanced."""
    depth = 0
    for brace in _BRACE.finditer(text, start):
        depth += 1 if brace.group() == "{" else -1
        if depth == 0:
            return text[start + 1:brace.start()], brace.end()
    return None


def _unwrap(text: str, command: str) -> str:
    """Every ``\\command{x}`` replaced by ``x``; each character is scanned once (the next search starts after)."""
    out, i, needle = [], 0, "\\" + command + "{"
    while (j := text.find(needle, i)) >= 0:
        found = _braced(text, j + len(needle) - 1)
        if found is None:
            break
        out.append(text[i:j] + found[0])
        i = found[1]
    return "".join(out) + text[i:]


_SPACING = re.compile(r"\\\\|\\\$|\\[!,;:> ]|\\q?quad|\\left|\\right|\\displaystyle|\\textstyle|~|\$")
_CMD_SPACE = re.compile(r"(\\[A-Za-z]+)\s+(?=[A-Za-z])")
_WHITESPACE = re.compile(r"\s+")
_DEGREES = re.compile(r"\^\{?\\circ\}?|°|\\%|%")
_FRAC_SHORT = re.compile(r"\\frac(\d)(\d)")
_FRAC_ONE = re.compile(r"\\frac(\d)(\{)|\\frac(\{[^{}]*\})(\d)")
_SQRT_SHORT = re.compile(r"\\sqrt(\w)")
_UNIT_COMMANDS = ("text", "mbox", "mathrm")
_UNIT_POWER = re.compile(r"\^(?:\d|\{\d\})")
_WRAPPERS = ("text", "textrm", "textbf", "mbox", "mathrm", "mathbf", "boldsymbol")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_LETTER_CHOICE = re.compile(r"\(([A-Z])\)")


def _space_or_row_break(m: re.Match) -> str:
    """A spacing command becomes a space; a matrix row break ``\\\\`` stays."""
    return m.group() if m.group() == "\\\\" else " "


def _strip_trailing_unit(s: str) -> str:
    """``5\\text{cm}`` / ``5\\text{cm}^2`` -> ``5``: a last ``\\text{...}`` (no braces inside) after something."""
    p = max(s.rfind("\\" + command + "{") for command in _UNIT_COMMANDS)
    if p <= 0:
        return s
    opening = s.index("{", p)
    close = s.find("}", opening)
    if close < 0 or "{" in s[opening + 1:close]:
        return s
    rest = s[close + 1:]
    return s[:p] if not rest or _UNIT_POWER.fullmatch(rest) else s


def _short_forms(s: str) -> str:
    """``\\dfrac``/``\\tfrac`` -> ``\\frac``; ``\\frac12`` -> ``\\frac{1}{2}``; ``\\sqrt2`` -> ``\\sqrt{2}``."""
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_ONE.sub(lambda m: f"\\frac{{{m[1]}}}{m[2]}" if m[1] else f"\\frac{m[3]}{{{m[4]}}}", s)
    return _SQRT_SHORT.sub(r"\\sqrt{\1}", s)


def normalize_math(answer: str) -> str:
    """A LaTeX answer in the canonical form of the verifiers' docstring (``math_boxed``)."""
    s = _SPACING.sub(_space_or_row_break, answer.replace("\0", ""))
    s = _CMD_SPACE.sub("\\1\0", s)  # "\\pi r" keeps one space ("\\pir" would be another command) ...
    s = _WHITESPACE.sub("", s).replace("\0", " ")  # ... and every other space goes
    s = s.replace("{,}", ",")
    s = _DEGREES.sub("", s).rstrip(".")
    s = _strip_trailing_unit(s)
    for command in _WRAPPERS:
        s = _unwrap(s, command)
    s = _short_forms(s)
    if s.count("=") == 1 and s[:1].isalpha() and s[1:2] == "=":
        s = s[2:]
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    choice = _LETTER_CHOICE.fullmatch(s)
    return choice.group(1) if choice else s.rstrip(".")


_RATIONAL = re.compile(r"([-+]?)(?:\\frac\{([-+]?\d+)\}\{(\d+)\}|(\d+)/(\d+)|(\d+(?:\.\d*)?|\.\d+))")
_MAX_RATIONAL_CHARS = 64


def _rational_match(normalized: str) -> re.Match | None:
    return _RATIONAL.fullmatch(normalized) if len(normalized) <= _MAX_RATIONAL_CHARS else None


def rational_value(normalized: str) -> Fraction | None:
    """The exact value of a canonical answer that is a rational number (``-\\frac{3}{4}``, ``\\frac{-3}{4}``,
    ``3/4``, ``0.75``); None for anything else, for a zero denominator and for strings over 64 characters."""
    m = _rational_match(normalized)
    if m is None:
        return None
    sign, num, den, num2, den2, plain = m.groups()
    try:
        value = Fraction(plain) if plain else Fraction(int(num or num2), int(den or den2))
    except (ZeroDivisionError, ValueError):
        return None
    return -value if sign == "-" else value


_COMMAND = re.compile(r"\\\\|\\[A-Za-z]+")  # a matrix row break (two backslashes) is no command
_ALLOWED_COMMANDS = frozenset(
    "frac sqrt pi infty cdot times div pm mp le leq ge geq lt gt ne neq in cup cap emptyset varnothing circ "
    "sin cos tan cot sec csc arcsin arccos arctan log ln exp alpha beta gamma delta epsilon theta lambda mu phi "
    "omega sigma tau rho text textrm textbf mbox mathrm mathbf boldsymbol begin end pmatrix bmatrix".split())
_INTEGER = re.compile(r"\d+")


def _exponent(s: str, caret: int) -> str:
    """The exponent after the ``^`` at ``caret``: a braced group (up to its matching brace) or one character."""
    if s[caret + 1:caret + 2] != "{":
        return s[caret + 1:caret + 2]
    found = _braced(s, caret + 1)
    return found[0] if found else s[caret + 1:]


def _power_cost(s: str, caret: int, power: int) -> int:
    """About the digits of ``base^power`` for the ``^`` at ``caret``: power x the digits of the base (an integer
    literal right before; for any other base, the longest integer literal of ``s``)."""
    start = caret
    while start and s[start - 1].isdigit():
        start -= 1
    base_digits = caret - start or max((len(d) for d in _INTEGER.findall(s)), default=1)
    return power * base_digits


def _powers_bounded(s: str, has_variables: bool) -> bool:
    """No power tower; each exponent at most :data:`MAX_EXPONENT` (or ``MAX_GROUP_EXPONENT`` on a bracketed group
    with variables); the powers together build numbers of at most :data:`MAX_POWER_DIGITS` digits."""
    budget = MAX_POWER_DIGITS
    for caret in (i for i, ch in enumerate(s) if ch == "^"):
        exponent = _exponent(s, caret)
        powers = [int(digits) for digits in _INTEGER.findall(exponent)]
        group = has_variables and caret > 0 and s[caret - 1] in ")]}"
        if "^" in exponent or any(p > (MAX_GROUP_EXPONENT if group else MAX_EXPONENT) for p in powers):
            return False
        budget -= sum(_power_cost(s, caret, p) for p in powers)
        if budget < 0:
            return False
    return True


def bounded_for_math_verify(s: str) -> bool:
    """Whether math-verify's cost on canonical answer ``s`` is bounded (module docstring: the gate)."""
    if len(s) > MATH_VERIFY_MAX_CHARS or "!" in s:
        return False
    if any(c[1:] not in _ALLOWED_COMMANDS for c in _COMMAND.findall(s) if c != "\\\\"):
        return False
    has_variables = any(ch.isalpha() for ch in _COMMAND.sub("", s))
    if has_variables and len(s) > MATH_VERIFY_MAX_SYMBOLIC_CHARS:
        return False
    return _powers_bounded(s, has_variables)


def _drop_timeout_notice(record: logging.LogRecord) -> bool:
    """math-verify warns once that its timeouts are off: they are off on purpose (module docstring)."""
    return not str(record.msg).startswith("Timeout is disabled")


for _logger in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_logger).addFilter(_drop_timeout_notice)


@lru_cache(maxsize=4096)
def _parsed(answer: str) -> tuple:
    """math-verify's parse of one canonical answer (sympy objects), signal timeouts off; cached (references repeat)."""
    from math_verify import LatexExtractionConfig, parse

    config = [LatexExtractionConfig(boxed_match_priority=0)]
    return tuple(parse("\\boxed{" + answer + "}", config, parsing_timeout=None))


def math_verify_equal(got: str, expected: str) -> bool:
    """HF math-verify's verdict on ``got`` against the gold ``expected`` (its order: gold first); timeouts off."""
    from math_verify import verify

    gold, target = _parsed(expected), _parsed(got)
    return bool(gold and target) and verify(list(gold), list(target), timeout_seconds=None)


def _is_word(s: str) -> bool:
    """A plain word of two or more letters (``Paris``, ``odd``): sympy would read it as a product of symbols."""
    return len(s) > 1 and s.isalpha()


def math_equal(got: str, expected: str) -> bool:
    """Whether the canonical answers ``got`` (the response's) and ``expected`` (the reference's) are the same
    answer: equal strings; else both rational (their exact values decide); else words compare case-blind; else
    math-verify, when both pass the gate."""
    if got == expected:
        return True
    if _rational_match(got) and _rational_match(expected):  # numbers: exact values decide (1/0 is no value)
        value = rational_value(got)
        return value is not None and value == rational_value(expected)
    if _is_word(got) or _is_word(expected):
        return got.casefold() == expected.casefold()
    if not (bounded_for_math_verify(got) and bounded_for_math_verify(expected)):
        return False
    return math_verify_equal(got, expected)
