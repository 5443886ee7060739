"""KL to the reference subtracted from the reward (PPO / RLHF style) instead of added to the loss.

For completion i the penalty is ``coef · Σ_t k(logp_old_it, ref_it)`` over its kept tokens, with
``logp_old`` the sampling policy's log-probs and k a KL estimator (k1 by default, as in PPO; k3 is
non-negative). It is subtracted from the completion's total before the advantages, so it shapes
the advantage rather than the gradient; the breakdown logs it as ``kl_penalty``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_engine.ops.kl import kl_estimator
from grpo_engine.types import Requirements, RewardOutput, RolloutBatch

__all__ = ["KLRewardPenalty"]


@dataclass(frozen=True)
class KLRewardPenalty:
    """A ``RewardTransform``: list it among the rewards, ``rewards=[MathAccuracy(), KLRewardPenalty(0.05)]``.

    Args:
        coef: β > 0.
        estimator: "k1", "k2" or "k3".

    Example:
        >>> pen = KLRewardPenalty(coef=0.5)
        >>> pen(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]]), torch.tensor([[True, True]]))
        tensor([0.2500])
    """

    coef: float
    estimator: str = "k1"

    def __post_init__(self) -> None:
        if not self.coef > 0:
            raise ValueError(f"coef={self.coef!r} must be > 0; a zero penalty is no KLRewardPenalty at all")
        kl_estimator(self.estimator)  # raises on unknown names

    @property
    def requires(self) -> Requirements:
        """The sampling policy's and the reference's log-probs."""
        return Requirements(old_logprobs=True, ref_logprobs=True)

    def __call__(self, old_logprobs: Tensor, ref_logprobs: Tensor, completion_mask: Tensor) -> Tensor:
        """[N] penalties from [N, C] log-probs and mask."""
        per_token = kl_estimator(self.estimator)(old_logprobs, ref_logprobs)
        return self.coef * torch.where(completion_mask, per_token, torch.zeros_like(per_token)).sum(dim=1)

    def transform(self, rewards: RewardOutput, batch: RolloutBatch, *, old_logprobs: Tensor | None,
                  ref_logprobs: Tensor | None) -> RewardOutput:
        """The rewards less each completion's penalty, which the breakdown logs as ``kl_penalty`` [B, G]."""
        if old_logprobs is None or ref_logprobs is None:
            raise ValueError("KLRewardPenalty needs old_logprobs and ref_logprobs [N, C]; "
                             "the trainer computes them when the rewards declare it (WeightedSum.requires)")
        mask = batch.loss_mask.to(old_logprobs.device)
        penalty = self(old_logprobs, ref_logprobs, mask).reshape(rewards.total.shape)
        return RewardOutput(total=rewards.total - penalty.to(rewards.total.device),
                            breakdown={**rewards.breakdown, "kl_penalty": penalty}, errors=rewards.errors,
                            metrics=rewards.metrics)
