"""Length rewards, scored on the sampled tokens rather than on the text alone.

:class:`FinishedOnly` counts another reward only where the completion ended (EOS within the limit):
a truncated completion scores ``unfinished`` (0) whatever its text says. Without it a completion cut at
the limit is graded on what it wrote so far, so a policy that states the answer and then talks on is
rewarded like one that stops, drifts into running on, and at a longer generation limit its later
numbers become its answer (the demo's run-on collapse, docs/benchmarks.md). Unlike a length penalty it
gives no reason to stop early: an empty completion scores what a wrong one does.

:class:`OverlongPenalty` is the soft overlong punishment of DAPO (arXiv 2503.14476). With L the
completion length in tokens, L_max = ``max_completion_tokens`` (the hard generation limit) and
L_c = ``cache_tokens`` (the soft zone below it):

    R_len(L) = 0                          if L <= L_max - L_c
    R_len(L) = ((L_max - L_c) - L) / L_c  if L_max - L_c < L <= L_max
    R_len(L) = -1                         if L > L_max

so it falls linearly from 0 to -1 over the last L_c tokens, and a completion cut at L_max gets -1
(DAPO: weight 1, L_max = 20,480, L_c = 4,096). L is ``RolloutBatch.completion_lengths``, the sampled
tokens up to and including the first EOS; with tools, the model's tokens only (a tool's reply is not the
model's length), while the rollout's budget counts both, so a rollout cut by its budget may score above
-1 (``FinishedOnly`` or ``Episode.end`` tell a cut rollout). Text carries no token count, so the reward
defines ``score_rollout(batch)``, which ``WeightedSum`` calls instead of ``__call__(prompts, completions)``;
calling it on texts raises a ``TypeError`` that says so.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from grpo_engine.rewards.base import Reward
from grpo_engine.types import Prompt, RolloutBatch

__all__ = ["OverlongPenalty", "FinishedOnly"]


def _check_tokens(value: object, name: str, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"OverlongPenalty: {name}={value!r} "
                         f"must be a positive integer number of tokens; {fix}")
    return int(value)


class OverlongPenalty(Reward):
    """DAPO soft overlong punishment: 0 up to ``max - cache`` tokens, then linearly down to -1 at ``max``.

    Args:
        max_completion_tokens: L_max, the hard limit on completion tokens (use the sampler's
            ``max_completion_tokens``).
        cache_tokens: L_c, the length of the soft zone, 0 < L_c <= L_max.
        weight: multiplier in :class:`~grpo_engine.rewards.WeightedSum` (DAPO uses 1.0).
        name: key in the logged breakdown; defaults to ``"overlong_penalty"``.

    Example:
        >>> penalty = OverlongPenalty(max_completion_tokens=8, cache_tokens=4)
        >>> penalty.penalty(torch.tensor([3, 4, 5, 8, 9]))
        tensor([ 0.0000,  0.0000, -0.2500, -1.0000, -1.0000])
    """

    def __init__(
        self, max_completion_tokens: int, cache_tokens: int, weight: float = 1.0, name: str | None = None
    ) -> None:
        super().__init__(weight=weight, name=name)
        self.max_completion_tokens = _check_tokens(
            max_completion_tokens, "max_completion_tokens", "pass the sampler's limit, e.g. 1024"
        )
        self.cache_tokens = _check_tokens(
            cache_tokens, "cache_tokens",
            f"pass 0 < cache_tokens <= max_completion_tokens={self.max_completion_tokens}"
        )
        if self.cache_tokens > self.max_completion_tokens:
            raise ValueError(
                f"OverlongPenalty: cache_tokens={cache_tokens!r} must be <= "
                f"max_completion_tokens={self.max_completion_tokens} (the soft zone lies inside the limit); "
                f"pass a smaller cache_tokens, e.g. {max(1, self.max_completion_tokens // 4)}"
            )

    def __repr__(self) -> str:
        return (
            f"OverlongPenalty(max_completion_tokens={self.max_completion_tokens}, "
            f"cache_tokens={self.cache_tokens}, weight={self.weight!r}, name={self.name!r})"
        )

    def penalty(self, lengths: Tensor) -> Tensor:
        """R_len of each length.

        Args:
            lengths: [N] completion lengths in tokens (any integer or real dtype).

        Returns:
            [N] float32 penalties in [-1, 0].
        """
        soft_start = self.max_completion_tokens - self.cache_tokens
        over = (soft_start - lengths.to(torch.float64)).clamp(max=0.0)  # <= 0 past the soft start
        return (over / self.cache_tokens).clamp(min=-1.0).to(torch.float32)

    def score_rollout(self, batch: RolloutBatch) -> Tensor:
        """[N] float32 penalties of the batch's completions, from ``batch.completion_lengths`` (the model's
        tokens; with tools, not the environment's)."""
        return self.penalty(batch.completion_lengths)

    def score(self, prompt: Prompt, completion: str) -> float:
        """Not available: a text has no token count. Raises ``TypeError``."""
        raise self._needs_lengths()

    def __call__(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> Tensor:
        """Not available: a text has no token count. Raises ``TypeError``."""
        raise self._needs_lengths()

    def _needs_lengths(self) -> TypeError:
        return TypeError(
            f"reward {self.name!r} (OverlongPenalty) scores completion lengths in tokens, which texts do not "
            "carry; use it inside WeightedSum (which calls score_rollout(batch)), or call "
            ".score_rollout(batch) / .penalty(lengths) yourself"
        )


class FinishedOnly(Reward):
    """``reward``'s score where the completion ended with EOS within the limit, ``unfinished`` where it
    was truncated (``RolloutBatch.is_truncated``): an answer counts only when the completion ends.

    Args:
        reward: the reward to gate (e.g. ``MathAccuracy()``); its ``check`` still checks the prompts.
        unfinished: the score of a truncated completion (0: what a wrong answer scores).
        weight, name: default to ``reward``'s, so the logs keep its key.

    Example:
        >>> from grpo_engine.rewards import MathAccuracy
        >>> FinishedOnly(MathAccuracy(isolate=False)).name
        'math_accuracy'
    """

    def __init__(self, reward: Any, unfinished: float = 0.0, weight: float | None = None,
                 name: str | None = None) -> None:
        super().__init__(weight=reward.weight if weight is None else weight, name=name or reward.name)
        if isinstance(unfinished, bool) or not isinstance(unfinished, numbers.Real) or not math.isfinite(
                unfinished):
            raise ValueError(f"FinishedOnly: unfinished={unfinished!r} must be a finite real number, e.g. "
                             "0.0")
        self.reward, self.unfinished = reward, float(unfinished)

    def __repr__(self) -> str:
        return f"FinishedOnly({self.reward!r}, unfinished={self.unfinished!r}, weight={self.weight!r})"

    def check(self, prompt: Prompt) -> str | None:
        """The gated reward's check."""
        check = getattr(self.reward, "check", None)
        return check(prompt) if callable(check) else None

    def score_rollout(self, batch: RolloutBatch) -> Tensor:
        """[N] the gated reward's scores, ``unfinished`` on the truncated completions."""
        scores = self.reward(batch.row_prompts, batch.texts)
        truncated = batch.is_truncated.to(scores.device)
        return torch.where(truncated, torch.full_like(scores, self.unfinished), scores)

    def score(self, prompt: Prompt, completion: str) -> float:
        """Not available: a text does not say whether it ended. Raises ``TypeError``."""
        raise TypeError(f"reward {self.name!r} (FinishedOnly) needs to know whether each completion ended, "
                        "which a text does not carry; use it inside WeightedSum (which calls "
                        "score_rollout(batch)), or call score_rollout(batch) yourself")

    def __call__(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> Tensor:
        """Not available: a text does not say whether it ended. Raises ``TypeError``."""
        return self.score(prompts[0] if prompts else Prompt(""), completions[0] if completions else "")
