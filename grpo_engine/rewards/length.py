"""Length rewards, scored on the sampled token count rather than on the text.

:class:`OverlongPenalty` is the soft overlong punishment of DAPO (arXiv 2503.14476). With L the
completion length in tokens, L_max = ``max_completion_tokens`` (the hard generation limit) and
L_c = ``cache_tokens`` (the soft zone below it):

    R_len(L) = 0                          if L <= L_max - L_c
    R_len(L) = ((L_max - L_c) - L) / L_c  if L_max - L_c < L <= L_max
    R_len(L) = -1                         if L > L_max

so it falls linearly from 0 to -1 over the last L_c tokens, and a completion cut at L_max gets -1
(DAPO: weight 1, L_max = 20,480, L_c = 4,096). L is ``RolloutBatch.completion_lengths``, the sampled
tokens up to and including the first EOS. Text carries no token count, so the reward defines
``score_rollout(batch)``, which ``WeightedSum`` calls instead of ``__call__(prompts, completions)``;
calling it on texts raises a ``TypeError`` that says so.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from grpo_engine.rewards.base import Reward
from grpo_engine.types import Prompt, RolloutBatch

__all__ = ["OverlongPenalty"]


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
        """[N] float32 penalties of the batch's completions, from ``batch.completion_lengths``."""
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
