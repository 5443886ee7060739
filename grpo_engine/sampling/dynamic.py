"""DAPO dynamic sampling: train only on groups that carry a learning signal; a group filter.

DAPO (arXiv 2503.14476, section 3.2) drops every group whose rewards are all equal (every advantage
0: no gradient, a diluted step) and samples fresh prompts until the batch is full.
``GRPOTrainer(sampler=DynamicSampling(...))`` makes the trainer do so (``grpo_engine.rollout``):

- A group is kept iff its rewards are not all equal: the total, or one reward of the breakdown
  with ``key`` (``key="math_accuracy"`` keeps exactly DAPO's 0 < accuracy < 1).
- Round 1 samples the step's prompts; each further round draws as many fresh prompts as groups
  are still missing, up to ``max_rounds`` rounds.
- Every group drawn stays in the rollout, scored, with the first B kept groups marked in
  ``trained_groups`` (none kept: the last round's, every advantage 0); metrics: rounds, groups
  sampled and kept, the mean reward of every group drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from grpo_engine.types import RewardOutput

__all__ = ["DynamicSampling"]


@dataclass(frozen=True)
class DynamicSampling:
    """Keeps sampling until ``B`` groups with unequal rewards are found (DAPO); a ``GroupFilter``.

    Args:
        max_rounds: sampling rounds per step at most (>= 1; 1 only filters).
        key: the breakdown reward to filter on (e.g. "math_accuracy"); None filters on the total.

    Example:
        >>> import torch
        >>> DynamicSampling().keep(RewardOutput(torch.tensor([[1.0, 1.0], [1.0, 0.0]]))).tolist()
        [False, True]
    """

    max_rounds: int = 3
    key: str | None = None

    def __post_init__(self) -> None:
        if self.max_rounds < 1:
            raise ValueError(f"max_rounds={self.max_rounds} must be >= 1; use e.g. 3")

    def keep(self, rewards: RewardOutput) -> Tensor:
        """[B] bool on the CPU: the groups whose rewards (the total, or ``key``'s) are not all equal.

        Raises:
            KeyError: ``key`` names no reward of the breakdown.
            ValueError: ``key``'s reward returned None for some sample (a group's spread is undefined).
        """
        if self.key is not None and self.key not in rewards.breakdown:
            raise KeyError(f"DynamicSampling(key={self.key!r}) but the rewards are "
                           f"{sorted(rewards.breakdown)}; use one of those names or key=None")
        signal = (rewards.total if self.key is None
                  else rewards.scored(self.key, f"DynamicSampling(key={self.key!r})"))
        return (signal != signal[:, :1]).any(dim=1).cpu()
