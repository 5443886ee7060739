"""Weighted sum of rewards: ``total[b, g] = sum_k weight_k * score_k[b * G + g]``.

Each reward is computed once on the N = B * G completions of a :class:`RolloutBatch`
(``batch.row_prompts``, ``batch.texts``); the unweighted [B, G] scores of each go into
``RewardOutput.breakdown`` under the reward's ``name`` for logging, and the weighted sum is
``RewardOutput.total`` [B, G], from which advantages are computed. A reward with weight 0 is
logged but does not train. No normalisation is applied here (that is the advantage's job).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from grpo_engine.protocols import RewardFn
from grpo_engine.rewards.base import RewardError
from grpo_engine.types import RewardOutput, RolloutBatch

__all__ = ["WeightedSum"]


class WeightedSum:
    """Combines rewards into the ``RewardOutput`` of a step.

    Args:
        rewards: one or more ``RewardFn`` (e.g. :class:`~grpo_engine.rewards.Reward`
            subclasses), each with a unique ``name`` and a finite ``weight``.

    Example:
        >>> from grpo_engine.rewards import MathAccuracy, ThinkAnswerFormat
        >>> combo = WeightedSum([MathAccuracy(), ThinkAnswerFormat(weight=0.1)])
        >>> combo.names
        ('math_accuracy', 'think_answer_format')
    """

    def __init__(self, rewards: Sequence[RewardFn]) -> None:
        rewards = tuple(rewards)
        if not rewards:
            raise ValueError(
                "WeightedSum needs at least one reward; pass e.g. WeightedSum([MathAccuracy()])"
            )
        seen: dict[str, RewardFn] = {}
        for reward in rewards:
            name = getattr(reward, "name", None)
            weight = getattr(reward, "weight", None)
            if not isinstance(name, str) or not name or not callable(reward):
                raise TypeError(
                    f"WeightedSum: {reward!r} is not a RewardFn (a callable with a non-empty str "
                    "`name` and a float `weight`); subclass grpo_engine.rewards.Reward"
                )
            if (
                isinstance(weight, bool)
                or not isinstance(weight, numbers.Real)
                or not math.isfinite(weight)
            ):
                raise ValueError(
                    f"WeightedSum: reward {name!r} has weight={weight!r}; "
                    "a weight must be a finite real number, e.g. 1.0"
                )
            if name in seen:
                raise ValueError(
                    f"WeightedSum: two rewards are named {name!r} ({seen[name]!r} and {reward!r}); "
                    f"names key the logged breakdown, so give each a unique one, "
                    f"e.g. {type(reward).__name__}(name='{name}_2')"
                )
            seen[name] = reward
        self.rewards: tuple[RewardFn, ...] = rewards

    @property
    def names(self) -> tuple[str, ...]:
        """The reward names, in order (the keys of ``RewardOutput.breakdown``)."""
        return tuple(r.name for r in self.rewards)

    def __repr__(self) -> str:
        return f"WeightedSum({list(self.rewards)!r})"

    def __call__(self, batch: RolloutBatch) -> RewardOutput:
        """Scores a batch.

        Args:
            batch: N = B * G completions with their prompts.

        Returns:
            ``total`` [B, G] float32, the weighted sum; ``breakdown`` name -> [B, G] float32
            unweighted scores.

        Raises:
            RewardError: a reward returned something other than a finite floating [N] tensor
                (or a ``Reward`` failed on a sample).
        """
        b, g = batch.num_prompts, batch.group_size
        prompts, texts = batch.row_prompts, batch.texts
        total = torch.zeros(b, g, dtype=torch.float32)
        breakdown: dict[str, Tensor] = {}
        for reward in self.rewards:
            scores = self._checked(reward, reward(prompts, texts), b * g)
            scores = scores.to(device=total.device, dtype=torch.float32).view(b, g)
            breakdown[reward.name] = scores
            total = total + float(reward.weight) * scores
        return RewardOutput(total=total, breakdown=breakdown)

    @staticmethod
    def _checked(reward: RewardFn, scores: object, n: int) -> Tensor:
        name = reward.name
        if not isinstance(scores, Tensor):
            raise RewardError(
                f"reward {name!r} returned {type(scores).__name__}; a RewardFn must return a "
                f"float tensor of shape [N]=[{n}] (torch.tensor(scores, dtype=torch.float32))"
            )
        if tuple(scores.shape) != (n,):
            raise RewardError(
                f"reward {name!r} returned shape {tuple(scores.shape)}; expected [N]=[{n}], "
                "one score per completion (flatten it, and score batch.row_prompts/batch.texts)"
            )
        if not scores.is_floating_point():
            raise RewardError(
                f"reward {name!r} returned dtype {scores.dtype}; expected a floating dtype "
                "(torch.float32); convert with .float()"
            )
        bad = torch.nonzero(~torch.isfinite(scores)).flatten()
        if bad.numel():
            raise RewardError(
                f"reward {name!r} returned non-finite scores at samples {bad[:8].tolist()} "
                f"(values {scores[bad[:8]].tolist()}); a reward must return finite numbers"
            )
        return scores
