"""Math answer correctness with math-verify (symbolic equivalence, no ``eval`` of model output).

Rules implemented by :class:`MathAccuracy`:

1. Answer extraction from the completion, first rule that applies:
   the content of the last ``<answer>...</answer>``; else the content of the last
   ``\\boxed{...}`` with balanced braces; else the last number of the completion (an integer,
   decimal, ``1,000``-style or ``a/b`` number, or a ``\\frac{a}{b}``). A tag or box that is
   present but blank means "no answer". The fallback is deliberately a single number, never an
   expression: math-verify would evaluate a restated question such as "To add 63 + 34, we..."
   to 97 and reward it, and a policy learns that hack within a few steps.
2. The extracted answer and ``Prompt.target`` are parsed the same way (:func:`parse_answer`):
   text with no ``$`` and no ``\\boxed`` is wrapped as ``$...$`` so plain gold answers parse
   (``"1000"``, ``"-7"``, ``"0.5"``, ``"\\frac{1}{2}"``, ``"1,000"``).
3. Score 1.0 iff ``math_verify.verify(gold, answer)``, else 0.0. No answer at all is 0.0, not an
   error. A prompt without ``target``, or a target math-verify cannot parse, is an error.

math-verify bounds parsing and comparison time with ``signal.alarm``, which only works in the
main thread: the timeouts are passed only there, and disabled (None) in other threads
(for example a reward computed in a thread pool). Parsed answers are cached (LRU).
"""

from __future__ import annotations

import re
import threading
from functools import lru_cache
from typing import Any

from math_verify import parse, verify

from grpo_engine.rewards.base import Reward, excerpt
from grpo_engine.rewards.format import boxed_contents
from grpo_engine.types import Prompt

__all__ = ["MathAccuracy", "answers_equal", "extract_answer", "final_answer", "last_number", "parse_answer"]

TIMEOUT_SECONDS = 5
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
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
    """Stripped content of the last answer tag, else of the last box; None when neither."""
    tags = _ANSWER_TAG.findall(completion)
    if tags:
        return tags[-1].strip()
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


def _equal(gold: list[Any], answer: list[Any]) -> bool:
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
    return _equal(parse_answer(a), parse_answer(b))


def final_answer(completion: str) -> str | None:
    """A completion's final answer by ``MathAccuracy``'s rule, or None.

    The content of the last ``<answer>`` tag, else of the last ``\\boxed{}``, else the last
    number; a tag or box that is present but blank means no answer.

    Example:
        >>> final_answer("so it is 12, or <answer> 13 </answer>"), final_answer("it is 7 or 8")
        ('13', '8')
        >>> final_answer("<answer> </answer> 12") is None
        True
    """
    span = _answer_span(completion)
    if span is None:
        span = last_number(completion)
    return span or None


class MathAccuracy(Reward):
    """1.0 iff the completion's final answer equals ``prompt.target`` (math-verify), else 0.0.

    See the module docstring for the extraction and wrapping rules.

    Example:
        >>> r = MathAccuracy()
        >>> p = Prompt("Half of 1?", target="0.5")
        >>> r([p, p, p], [r"\\boxed{\\frac{1}{2}}", "<answer>1/3</answer>", "I give up"])
        tensor([1., 0., 0.])
    """

    def score(self, prompt: Prompt, completion: str) -> float:
        if prompt.target is None:
            raise ValueError(
                "MathAccuracy needs Prompt.target (the reference answer) but it is None; "
                "build prompts with Prompt(question, target='42') or drop MathAccuracy"
            )
        gold = parse_answer(prompt.target)
        if not gold:
            raise ValueError(
                f"math-verify cannot parse Prompt.target={excerpt(prompt.target)}; "
                "write the target as LaTeX math, e.g. '\\frac{1}{2}' or '$x^2$'"
            )
        span = final_answer(completion)
        if span is None:
            return 0.0
        answer = parse_answer(span)
        return 1.0 if _equal(gold, answer) else 0.0
