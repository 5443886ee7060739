"""Math answer correctness: :class:`MathAccuracy` scores 1.0 iff a completion's final answer equals
``Prompt.target`` under math-verify (symbolic equivalence; model output is never executed).

The extraction and equivalence rules are :mod:`grpo_engine.ops.answers` (re-exported here): the last
``<answer>`` tag, else the last ``\\boxed{}``, else the last number, read from the completion's last
4,096 characters; no answer scores 0.0. A prompt without ``target``, or a target math-verify cannot
parse, is an error (:meth:`MathAccuracy.check` finds it when the trainer is built). Verification runs
in worker processes (``isolate=True``, :mod:`grpo_engine.ops.verify_pool`), where math-verify's own
timeouts work and a runaway parse is killed and scored 0.0; ``isolate=False`` verifies in this process.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from grpo_engine.ops.answers import (
    answers_equal,
    extract_answer,
    final_answer,
    last_number,
    parse_answer,
    verify_parsed,
)
from grpo_engine.ops.verify_pool import shared_pool
from grpo_engine.rewards.base import Reward, excerpt
from grpo_engine.types import Prompt

_PLAIN_NUMBER = re.compile(r"^\s*-?\d[\d,]*(\.\d+)?\s*$")
_WORDS = re.compile(r"(?<![\\a-zA-Z])[a-zA-Z]{3,}")  # a word of 3+ letters (prose, when there is no LaTeX)
_MATH_WORDS = {"sin", "cos", "tan", "cot", "sec", "csc", "log", "exp", "sqrt", "sinh", "cosh", "tanh",
               "arcsin", "arccos", "arctan", "inf", "infty", "max", "min", "mod", "gcd", "lcm", "det"}
__all__ = ["MathAccuracy", "answers_equal", "extract_answer", "final_answer", "last_number", "parse_answer"]


class MathAccuracy(Reward):
    """1.0 iff the completion's final answer equals ``prompt.target`` (math-verify), else 0.0.

    Args:
        weight, name: as for every :class:`Reward`.
        isolate: verify in worker processes (the default) rather than in this process.

    Example:
        >>> r = MathAccuracy(isolate=False)
        >>> p = Prompt("Half of 1?", target="0.5")
        >>> r([p, p, p], [r"\\boxed{\\frac{1}{2}}", "<answer>1/3</answer>", "I give up"])
        tensor([1., 0., 0.])
    """

    def __init__(self, weight: float = 1.0, name: str | None = None, *, isolate: bool = True) -> None:
        super().__init__(weight, name)
        self.isolate = isolate

    def check(self, prompt: Prompt) -> str | None:
        """Why ``prompt.target`` cannot be a math answer (missing, not parsable, prose without LaTeX
        or digits such as ``"hello world"``), or None; ``"\\text{east}"`` is an answer."""
        target = prompt.target
        if target is None:
            return "no target (the reference answer); build the prompt with Prompt(question, target='42')"
        if _PLAIN_NUMBER.match(target):
            return None
        prose = [w for w in _WORDS.findall(target) if w.lower() not in _MATH_WORDS]
        if prose and "\\" not in target and not any(ch.isdigit() for ch in target):
            return (f"target {excerpt(target)} is words, not a math answer; "
                    "write the answer as a number or LaTeX")
        if not parse_answer(target):
            return (f"math-verify cannot parse target {excerpt(target)}; "
                    f"write it as LaTeX math, e.g. '\\frac{{1}}{{2}}'")
        return None

    def score(self, prompt: Prompt, completion: str) -> float:
        gold = self._gold(prompt)
        span = final_answer(completion)
        if span is None:
            return 0.0
        return 1.0 if verify_parsed(gold, parse_answer(span)) else 0.0

    def score_batch(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float]:
        if not self.isolate:
            return super().score_batch(prompts, completions)
        for i, prompt in enumerate(prompts):
            if prompt.target is None:
                self._score_one(i, prompt, completions[i])  # raises, naming the sample and the fix
        spans = [final_answer(c) for c in completions]
        asked = [i for i, span in enumerate(spans) if span is not None]
        results = shared_pool().verify([(prompts[i].target, spans[i]) for i in asked])
        scores = [0.0] * len(completions)
        for i, (equal, error) in zip(asked, results, strict=True):
            if error == "gold":
                self._score_one(i, prompts[i], completions[i])  # raises, naming the sample and the target
            scores[i] = 1.0 if equal else 0.0
        return scores

    def _gold(self, prompt: Prompt) -> list:
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
        return gold
