"""Math answer correctness: :class:`MathAccuracy` scores 1.0 iff a completion's final answer equals
``Prompt.target`` under math-verify (symbolic equivalence; model output is never executed).

The extraction and equivalence rules are :mod:`grpo_engine.ops.answers` (re-exported here): the last
``<answer>`` tag, else the last ``\\boxed{}``, else the last number; no answer scores 0.0. A prompt
without ``target``, or a target math-verify cannot parse, is an error.
"""

from __future__ import annotations

from grpo_engine.ops.answers import (
    answers_equal,
    extract_answer,
    final_answer,
    last_number,
    parse_answer,
    verify_parsed,
)
from grpo_engine.rewards.base import Reward, excerpt
from grpo_engine.types import Prompt

__all__ = ["MathAccuracy", "answers_equal", "extract_answer", "final_answer", "last_number", "parse_answer"]


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
        return 1.0 if verify_parsed(gold, answer) else 0.0
