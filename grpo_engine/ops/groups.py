"""Statistics of reward groups [B, G] (row b holds the G rewards of prompt b), shared by the
advantage estimators and the reward combination.

:func:`centered` checks the shape (2-D, G >= 2) and subtracts the group mean; :func:`group_zscore`
divides by the unbiased group std + eps (GRPO's rule); a group whose rewards are all equal gets
exactly 0 (:func:`zero_where`); :func:`zero_std_fraction` counts such groups. float32, or float64
for float64 input. Pure.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["centered", "check_eps", "equal_groups", "group_zscore", "zero_std_fraction", "zero_where"]


def check_eps(eps: float, owner: str) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:  # `not >=` rejects NaN
        raise ValueError(f"{owner}: eps={eps!r} must be >= 0; pass a small non-negative number such as 1e-6")


def centered(rewards: Tensor, owner: str) -> tuple[Tensor, Tensor, Tensor]:
    """Checks ``rewards`` [B, G] (G >= 2) and returns (float rewards, r - mean_g r,
    [B, 1] equal-group mask)."""
    if rewards.dim() != 2:
        raise ValueError(
            f"{owner}: rewards shape {tuple(rewards.shape)} must be 2-D [B, G] (prompts x group); "
            "reshape the flat [N] rewards with rewards.view(-1, group_size)"
        )
    if rewards.shape[1] < 2:
        raise ValueError(f"{owner}: group_size={rewards.shape[1]} makes every advantage 0; "
                         "use group_size >= 2")
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    return r, r - r.mean(dim=1, keepdim=True), equal_groups(r)


def equal_groups(rewards: Tensor) -> Tensor:
    """[B, 1] True where every reward of the group equals its first one."""
    return (rewards == rewards[:, :1]).all(dim=1, keepdim=True)


def zero_where(equal: Tensor, advantages: Tensor) -> Tensor:
    return torch.where(equal, torch.zeros_like(advantages), advantages)


def group_zscore(rewards: Tensor, eps: float = 1e-6, owner: str = "group_zscore") -> Tensor:
    """(r - mean_g r) / (std_g r + eps), unbiased std over each group; exactly 0 in equal groups.

    Example:
        >>> group_zscore(torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]]))
        tensor([[ 1.5000, -0.5000, -0.5000, -0.5000],
                [ 0.0000,  0.0000,  0.0000,  0.0000]])
    """
    r, advantages, equal = centered(rewards, owner)
    return zero_where(equal, advantages / (r.std(dim=1, keepdim=True, correction=1) + eps))


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
    return equal_groups(rewards).to(torch.float32).mean()
