"""Final answers of math completions, and their equivalence (math-verify; model output is never executed).

- Extraction (:func:`final_answer`): the content of the last ``<answer>...</answer>``, else of the
  last brace-balanced ``\\boxed{...}``, else the last number (an integer, decimal, ``1,000``-style
  or ``a/b`` number, or a ``\\frac{a}{b}``). A tag or box that is present but blank means no answer.
  The fallback is a single number, never an expression.
- Equivalence (:func:`answers_equal`): both sides are parsed the same way (:func:`parse_answer`:
  text with no ``$`` and no ``\\boxed`` is wrapped as ``$...$``), then ``math_verify.verify``.
- math-verify bounds its time with ``signal.alarm``, which works only in the main thread: the
  timeouts are passed there and disabled in other threads. Parses are cached (LRU).
"""

from __future__ import annotations

import logging
import re
import threading
from functools import lru_cache
from typing import Any

from math_verify import parse, verify

__all__ = ["ShortLogs", "answers_equal", "boxed_contents", "extract_answer", "final_answer", "last_number",
           "parse_answer", "verify_parsed", "MAX_CHARS"]

TIMEOUT_SECONDS = 5
_BRACES = re.compile(r"\\boxed\{|[{}]")  # box openings and braces, found in one linear scan
MAX_CHARS = 4096  # the final answer is read from the last this many characters of a completion


class ShortLogs(logging.Filter):
    """Cuts a log message to 300 characters (math-verify quotes whole answers in its timeout errors)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if len(message) > 300:
            record.msg, record.args = message[:300] + " ... [cut]", None
        return True


# a logger's filters see only its own records, so every math-verify module's logger gets one
for _name in ("math_verify", "math_verify.parser", "math_verify.grader", "math_verify.metric",
              "math_verify.utils", "math_verify.tasks", "latex2sympy2_extended.math_normalization"):
    logging.getLogger(_name).addFilter(ShortLogs())
_NUMBER = re.compile(
    r"\\d?frac\{-?\d+\}\{-?\d+\}"  # \frac{1}{2}, \dfrac{3}{4}
    r"|-?\d{1,3}(?:,\d{3})+(?:\.\d+)?"  # 1,000 and 12,345.5
    r"|-?\d+(?:\.\d+)?(?:/\d+)?"  # 42, -7, 0.5, 3/4
)


def last_number(text: str) -> str | None:
    """The last number in ``text`` (see the module docstring), or None.

    Example:
        >>> last_number("12 + 95 = 120."), last_number("so x = -3/4, done"), last_number("none")
        ('120', '-3/4', None)
    """
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def _timeout() -> int | None:
    """math-verify's signal-based timeout in the main thread, None (disabled) elsewhere."""
    return TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None


def _answer_span(completion: str) -> str | None:
    """Stripped content of the last answer tag, else of the last box; None when neither. Linear time."""
    end = completion.rfind("</answer>")
    start = completion.rfind("<answer>", 0, end) if end != -1 else -1
    if start != -1:
        return completion[start + len("<answer>"):end].strip()
    boxes = boxed_contents(completion)
    if boxes:
        return boxes[-1].strip()
    return None


def extract_answer(completion: str) -> str | None:
    """The raw final-answer text of a completion.

    The content of the last ``<answer>...</answer>``, else of the last balanced
    ``\\boxed{...}``; stripped. None when neither is present or the content is blank.

    Args:
        completion: a decoded completion.

    Returns:
        The answer text, or None.

    Example:
        >>> extract_answer("<think>..</think><answer> 12 </answer>")
        '12'
        >>> extract_answer(r"so \\boxed{\\frac{1}{2}}.") == r"\\frac{1}{2}"
        True
        >>> extract_answer("twelve, I think") is None
        True
    """
    return _answer_span(completion) or None


def _wrap(text: str) -> str:
    if "$" in text or "\\boxed" in text:
        return text
    return f"${text}$"


@lru_cache(maxsize=4096)
def _parse_cached(text: str, timeout: int | None) -> tuple[Any, ...]:
    return tuple(parse(text, parsing_timeout=timeout))


def parse_answer(text: str, *, wrap: bool = True) -> list[Any]:
    """Parses an answer with math-verify (cached), the same way for gold and prediction.

    Args:
        text: an answer such as ``"0.5"``, ``"\\frac{1}{2}"`` or ``"$x^2$"``.
        wrap: wrap text with no ``$`` and no ``\\boxed`` as ``$...$`` first.

    Returns:
        math-verify's parse (sympy objects and their strings); empty when nothing parses.
    """
    text = _wrap(text) if wrap else text
    return list(_parse_cached(text, _timeout()))


def verify_parsed(gold: list[Any], answer: list[Any]) -> bool:
    """``math_verify.verify`` of two parses (from :func:`parse_answer`); an empty parse equals nothing."""
    if not gold or not answer:
        return False
    return bool(verify(gold, answer, timeout_seconds=_timeout()))


def answers_equal(a: str, b: str) -> bool:
    """Whether two answer texts are mathematically equal (math-verify, ``a`` taken as gold).

    Both sides are wrapped and parsed the same way (:func:`parse_answer`); an answer that does
    not parse equals nothing.

    Args:
        a: an answer text, e.g. from :func:`extract_answer`.
        b: another one.

    Example:
        >>> answers_equal(r"\\frac{1}{2}", "0.5"), answers_equal("1,000", "1000")
        (True, True)
    """
    return verify_parsed(parse_answer(a), parse_answer(b))


def final_answer(completion: str, max_chars: int = MAX_CHARS) -> str | None:
    """A completion's final answer by ``MathAccuracy``'s rule, or None.

    The content of the last ``<answer>`` tag, else of the last ``\\boxed{}``, else the last
    number; a tag or box that is present but blank means no answer.

    Example:
        >>> final_answer("so it is 12, or <answer> 13 </answer>"), final_answer("it is 7 or 8")
        ('13', '8')
        >>> final_answer("<answer> </answer> 12") is None
        True
    """
    completion = completion[-max_chars:]  # bounded work and log lines, whatever the completion's length
    span = _answer_span(completion)
    if span is None:
        span = last_number(completion)
    return span or None


def boxed_contents(text: str) -> list[str]:
    """The contents of every ``\\boxed{...}`` of ``text`` whose braces balance, in order.

    Nested braces are followed (``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``); a box whose
    closing brace never comes (a truncated completion) is skipped.

    Args:
        text: any string.

    Returns:
        The inner strings, unstripped, first to last.

    Example:
        >>> boxed_contents(r"so \\boxed{\\frac{1}{2}} or \\boxed{3")
        ['\\\\frac{1}{2}']
    """
    found: list[tuple[int, str]] = []
    open_boxes: list[tuple[int, int]] = []  # (content start, brace depth inside the box)
    depth = 0
    for match in _BRACES.finditer(text):  # one pass: linear however many boxes never close
        if match.group() == "}":
            if open_boxes and open_boxes[-1][1] == depth:
                begin, _ = open_boxes.pop()
                found.append((begin, text[begin:match.start()]))
            depth -= 1
        else:  # "{" or a box opening
            depth += 1
            if match.group() != "{":
                open_boxes.append((match.end(), depth))
    return [content for _, content in sorted(found)]
