"""Composable terms of :class:`~grpo_engine.losses.ClippedSurrogate`, each a small frozen record.

A term changes one thing, in this order: a **token filter** narrows which tokens count (and the
step counts), a **surrogate weight** rescales or masks the policy term of each token, a **penalty**
adds a per-token value to the loss before the aggregation. Each declares what it needs
(:class:`~grpo_engine.types.Requirements`). The terms: :class:`MaskTruncated` (DAPO's overlong
filtering), :class:`TruncatedIS` (truncated importance sampling against the sampler's log-probs),
:class:`HighEntropyTokens` (the policy term on the top-ρ entropy tokens only, arXiv 2506.01939),
:class:`KLPenalty` (β · a KL estimator to the reference, GRPO's) and :class:`EntropyBonus`
(-c · token entropy). Padded positions never reach arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_engine.losses._common import masked, safe_exp
from grpo_engine.losses.aggregation import token_share
from grpo_engine.ops.kl import KL_ESTIMATORS, kl_estimator
from grpo_engine.ops.tokens import high_entropy_mask, valid_values
from grpo_engine.types import MicroBatch, Requirements

__all__ = ["MaskTruncated", "TruncatedIS", "HighEntropyTokens", "KLPenalty", "EntropyBonus", "kl_tokens"]


def kl_tokens(name: str, logp: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """[n, C] estimator ``name`` of KL(π_θ ‖ π_ref) per token, 0 on padding; gradient into ``logp``."""
    ref = masked(ref_logprobs.detach(), mask, logp.dtype)
    kl = kl_estimator(name)(logp, ref)
    return torch.where(mask, kl, torch.zeros_like(kl))


@dataclass(frozen=True)
class MaskTruncated:
    """Token filter: a completion without EOS (``batch.is_truncated``) adds nothing to loss, gradient or
    metrics, and leaves both step counts (DAPO's overlong filtering)."""

    requires = Requirements(zero_advantage_rows=False)

    def filter(self, mask: Tensor, batch: MicroBatch) -> Tensor:
        if batch.is_truncated is None:
            raise ValueError("mask_truncated needs batch.is_truncated, which is None; pass the [n] truncation "
                             "flags or drop the MaskTruncated term")
        return mask & ~batch.is_truncated.to(device=mask.device, dtype=torch.bool)[:, None]

    def keep_rows(self, is_truncated: Tensor | None) -> Tensor:
        """[N] rows that count in the step."""
        if is_truncated is None:
            raise ValueError("ClippedSurrogate.counts: mask_truncated=True needs is_truncated [N]; "
                             "pass batch.is_truncated")
        return ~is_truncated.to(torch.bool)


@dataclass(frozen=True)
class TruncatedIS:
    """Surrogate weight: each token's policy term times the detached min(π_old / π_sampler, ``cap``),
    for samples drawn by another engine or precision than the trainer's (metric ``tis_weight``)."""

    cap: float

    def __post_init__(self) -> None:
        if not self.cap > 0:
            raise ValueError(f"tis_cap={self.cap!r} must be > 0; use e.g. 2.0, or None to turn it off")

    @property
    def requires(self) -> Requirements:
        return Requirements(sampler_logprobs=True, zero_advantage_rows=False)

    def apply(self, policy: Tensor, clipped: Tensor, logp: Tensor, old: Tensor, mask: Tensor, batch: MicroBatch,
              num_valid_tokens: int) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        if batch.sampler_logprobs is None:
            raise ValueError(f"tis_cap={self.cap} needs batch.sampler_logprobs [n, C], which is None; use a "
                             "sampler that reports log-probs (HFSampler does) or set tis_cap=None")
        sampler = masked(batch.sampler_logprobs.detach(), mask, logp.dtype)
        weight = safe_exp(old - sampler).clamp(max=self.cap)
        return policy * weight, clipped, {"tis_weight": token_share(weight, mask, num_valid_tokens)}


@dataclass(frozen=True)
class HighEntropyTokens:
    """Surrogate weight: the policy term only on the micro-batch's valid tokens in the top ``quantile``
    fraction by (detached) entropy, 0 elsewhere; counts unchanged (metric ``high_entropy_fraction``).
    Under torchrun the threshold is over this micro-batch of every rank (``MicroBatch.gather``)."""

    quantile: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile={self.quantile!r} must be in [0, 1] (the fraction of tokens "
                             "kept); the paper uses 0.2, None turns it off")

    @property
    def requires(self) -> Requirements:  # rows with A = 0 move the quantile: they must be run
        return Requirements(entropy=True, zero_advantage_rows=True, micro_batch_gather=True)

    def apply(self, policy: Tensor, clipped: Tensor, logp: Tensor, old: Tensor, mask: Tensor, batch: MicroBatch,
              num_valid_tokens: int) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        among = batch.gather(valid_values(batch.entropy, mask)) if batch.gather is not None else None
        high = high_entropy_mask(batch.entropy.detach(), mask, self.quantile, among=among)
        policy = torch.where(high, policy, torch.zeros((), dtype=logp.dtype, device=logp.device))
        return policy, clipped & high, {"high_entropy_fraction": high.sum().to(logp.dtype) / num_valid_tokens}


@dataclass(frozen=True)
class KLPenalty:
    """Penalty: ``coef`` · an estimator of KL(π_θ ‖ π_ref) per token ("k3" GRPO's, "k2", "k1"; see
    :mod:`grpo_engine.ops.kl`), not weighted by the ratio (metric ``kl``, the token mean)."""

    coef: float
    estimator: str = "k3"

    def __post_init__(self) -> None:
        if not self.coef > 0:
            raise ValueError(f"kl_coef={self.coef!r} must be > 0 for a KL term; drop the term to turn it off")
        if not (isinstance(self.estimator, str) and self.estimator in KL_ESTIMATORS):
            raise ValueError(f"kl_estimator={self.estimator!r} is not one of {tuple(KL_ESTIMATORS)}; pick one of them")

    @property
    def requires(self) -> Requirements:
        return Requirements(ref_logprobs=True, zero_advantage_rows=True)

    def tokens(self, logp: Tensor, mask: Tensor, batch: MicroBatch,
               num_valid_tokens: int) -> tuple[Tensor, dict[str, Tensor]]:
        kl = kl_tokens(self.estimator, logp, batch.ref_logprobs, mask)
        return self.coef * kl, {"kl": token_share(kl, mask, num_valid_tokens).detach()}


@dataclass(frozen=True)
class EntropyBonus:
    """Penalty: -``coef`` · the token entropy (with gradient), so higher entropy lowers the loss
    (metric ``entropy``, the token mean)."""

    coef: float

    def __post_init__(self) -> None:
        if not self.coef > 0:
            raise ValueError(f"entropy_coef={self.coef!r} must be > 0 for a bonus; drop the term to turn it off")

    @property
    def requires(self) -> Requirements:
        return Requirements(entropy=True, zero_advantage_rows=True)

    def tokens(self, logp: Tensor, mask: Tensor, batch: MicroBatch,
               num_valid_tokens: int) -> tuple[Tensor, dict[str, Tensor]]:
        entropy = masked(batch.entropy, mask, logp.dtype)
        return -self.coef * entropy, {"entropy": token_share(entropy, mask, num_valid_tokens).detach()}
