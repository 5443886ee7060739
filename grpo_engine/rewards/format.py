"""Format rewards: does a completion have the shape the prompt asked for?

- :class:`ThinkAnswerFormat` (the DeepSeek-R1 format reward): 1.0 iff the whole completion is
  ``<think>...</think>`` followed by ``<answer>...</answer>``, with only whitespace before,
  between and after, exactly one of each tag, in that order; the contents may span lines and
  may be empty (correctness is :class:`~grpo_engine.rewards.MathAccuracy`'s job). Else 0.0.
- :class:`BoxedFormat`: 1.0 iff the completion contains a ``\\boxed{...}`` whose braces balance
  and whose content is not blank. Else 0.0.

:func:`boxed_contents` (the brace-balanced ``\\boxed{...}`` scanner) lives in :mod:`grpo_engine.ops.answers`.
"""

from __future__ import annotations

import re

from grpo_engine.ops.answers import boxed_contents
from grpo_engine.rewards.base import Reward
from grpo_engine.types import Prompt

__all__ = ["BoxedFormat", "ThinkAnswerFormat", "boxed_contents"]

_THINK_ANSWER = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


class ThinkAnswerFormat(Reward):
    """1.0 iff the completion is exactly ``<think>...</think><answer>...</answer>``, else 0.0.

    Whitespace is allowed around and between the two blocks; each tag must occur exactly once.

    Example:
        >>> r = ThinkAnswerFormat()
        >>> r([Prompt("q")] * 2, ["<think>7+5</think>\\n<answer>12</answer>", "12"])
        tensor([1., 0.])
    """

    def score(self, prompt: Prompt, completion: str) -> float:
        if any(completion.count(tag) != 1 for tag in _TAGS):
            return 0.0
        return 1.0 if _THINK_ANSWER.fullmatch(completion) else 0.0


class BoxedFormat(Reward):
    """1.0 iff the completion contains a balanced, non-blank ``\\boxed{...}``, else 0.0.

    Example:
        >>> r = BoxedFormat()
        >>> r([Prompt("q")] * 3, [r"\\boxed{12}", r"\\boxed{ }", r"\\boxed{12"])
        tensor([1., 0., 0.])
    """

    def score(self, prompt: Prompt, completion: str) -> float:
        return 1.0 if any(c.strip() for c in boxed_contents(completion)) else 0.0
