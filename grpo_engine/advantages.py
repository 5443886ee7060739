"""Group-relative advantages: one scalar per completion from the rewards of its group.

``GroupNormalized`` implements the outcome-supervision advantage of GRPO (DeepSeekMath,
Shao et al. 2024, arXiv 2402.03300), broadcast by the loss to every token of the completion:

    A_bg = (r_bg - mean_g r_b) / (std_g r_b + eps)

* ``std`` is the unbiased (Bessel, divide by G - 1) standard deviation over the G completions
  of the group, as TRL and verl compute it; ``eps`` (default 1e-6, verl's value) is added to it.
* ``scale_by_std=False`` gives the mean-only advantage A_bg = r_bg - mean_g r_b of Dr. GRPO
  (Liu et al. 2025, arXiv 2503.20783), which removes the 1/std up-weighting of too easy and too
  hard prompts; (G / (G - 1)) times it is the RLOO advantage.
* A group whose G rewards are all equal gets advantage exactly 0 (in both modes), whatever
  rounding the mean has: it carries no learning signal.
* G = 1 is rejected (every advantage would be 0), unlike verl's mean 0 / std 1 fallback.

Computation is in float32, or float64 for float64 rewards. Pure: no ``.item()``, no logging.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["GroupNormalized", "zero_std_fraction"]


def _check_rewards(rewards: Tensor) -> None:
    """Raises ValueError unless ``rewards`` is [B, G] with G >= 2."""
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards shape {tuple(rewards.shape)} must be 2-D [B, G] (prompts x group); "
            "reshape the flat [N] rewards with rewards.view(-1, group_size)"
        )
    if rewards.shape[1] < 2:
        raise ValueError(
            f"group_size={rewards.shape[1]} makes every advantage 0; use group_size >= 2"
        )


def _equal_groups(rewards: Tensor) -> Tensor:
    """[B, 1] True where every reward of the group equals its first one."""
    return (rewards == rewards[:, :1]).all(dim=1, keepdim=True)


@dataclass(frozen=True)
class GroupNormalized:
    """Group z-score (GRPO) or group mean baseline (Dr. GRPO) advantages.

    Args:
        scale_by_std: divide by the group's unbiased std + ``eps`` (GRPO); False subtracts the
            group mean only (Dr. GRPO).
        eps: >= 0, added to the std before dividing; unused when ``scale_by_std`` is False.

    Example:
        >>> GroupNormalized()(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
        tensor([[ 1.5000, -0.5000, -0.5000, -0.5000]])
        >>> GroupNormalized(scale_by_std=False)(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
        tensor([[ 0.7500, -0.2500, -0.2500, -0.2500]])
    """

    scale_by_std: bool = True
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if not self.eps >= 0:  # also rejects NaN
            raise ValueError(f"eps={self.eps!r} must be >= 0; pass a small non-negative number")

    def __call__(self, rewards: Tensor, *, uncertainty: Tensor | None = None) -> Tensor:
        """Advantages of every completion relative to its group.

        Args:
            rewards: [B, G] total reward of each completion, G >= 2 (any real or integer dtype).
            uncertainty: [B] per-group uncertainty; accepted for the ``AdvantageFn`` protocol
                and ignored (this estimator does not use it).

        Returns:
            [B, G] advantages, float32 (float64 for float64 rewards); exact 0 in groups whose
            rewards are all equal.

        Raises:
            ValueError: if ``rewards`` is not 2-D or G < 2.
        """
        del uncertainty  # not used by this estimator
        _check_rewards(rewards)
        r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
        advantages = r - r.mean(dim=1, keepdim=True)
        if self.scale_by_std:
            advantages = advantages / (r.std(dim=1, keepdim=True, correction=1) + self.eps)
        return torch.where(_equal_groups(r), torch.zeros_like(advantages), advantages)


def zero_std_fraction(rewards: Tensor) -> Tensor:
    """Fraction of groups whose rewards are all equal (no learning signal), for metrics.

    Args:
        rewards: [B, G] total reward of each completion, B >= 1.

    Returns:
        Scalar float32 tensor in [0, 1].

    Example:
        >>> zero_std_fraction(torch.tensor([[1.0, 1.0], [0.0, 1.0]]))
        tensor(0.5000)
    """
    if rewards.dim() != 2 or rewards.shape[0] < 1:
        raise ValueError(
            f"rewards shape {tuple(rewards.shape)} must be 2-D [B, G] with B >= 1; "
            "reshape the flat [N] rewards with rewards.view(-1, group_size)"
        )
    return _equal_groups(rewards).to(torch.float32).mean()
