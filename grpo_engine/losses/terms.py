"""Composable terms of :class:`~grpo_engine.losses.ClippedSurrogate`, each a small frozen record.

A **row filter** (``RowFilter``: ``keep_rows``) drops whole completions from the loss and from the
step counts. A **loss term** (``LossTerm``: called on a :class:`~grpo_engine.types.TokenLoss`, returns
a new one) changes the per-token loss after the clip: a surrogate weight rescales or masks the policy
term of each token, a penalty adds to each token's loss before the aggregation. Each declares what it
needs (:class:`~grpo_engine.types.Requirements`); the loss checks that the micro-batch carries it.
The terms: :class:`MaskTruncated` (DAPO's overlong filtering), :class:`TruncatedIS` (truncated
importance sampling against the sampler's log-probs), :class:`HighEntropyTokens` (the policy term on
the top-ρ entropy tokens only, arXiv 2506.01939), :class:`KLPenalty` (β · a KL estimator to the
reference, GRPO's), :class:`RatioWeightedKL` (the same times the ratio, TRL's bias-corrected KL),
:class:`OffPolicySequenceMask` (DeepSeek-V3.2's mask of stale negative sequences) and
:class:`EntropyBonus` (-c · token entropy). Padded positions never reach arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_engine.losses._common import masked, safe_exp
from grpo_engine.losses.aggregation import token_share
from grpo_engine.ops.kl import KL_ESTIMATORS, kl_estimator
from grpo_engine.ops.tokens import high_entropy_mask
from grpo_engine.types import MicroBatch, Requirements, TokenLoss

__all__ = ["MaskTruncated", "TruncatedIS", "HighEntropyTokens", "KLPenalty", "RatioWeightedKL",
           "OffPolicySequenceMask", "EntropyBonus", "icepop", "kl_tokens"]


def kl_tokens(name: str, logp: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """[n, C] estimator ``name`` of KL(π_θ ‖ π_ref) per token, 0 on padding; gradient into ``logp``."""
    ref = masked(ref_logprobs.detach(), mask, logp.dtype)
    kl = kl_estimator(name)(logp, ref)
    return torch.where(mask, kl, torch.zeros_like(kl))


@dataclass(frozen=True)
class MaskTruncated:
    """Row filter: a completion without EOS (``is_truncated``) adds nothing to loss, gradient or
    metrics, and leaves both step counts (DAPO's overlong filtering)."""

    requires = Requirements(zero_advantage_rows=False)

    def __str__(self) -> str:
        return "mask_truncated=True"

    def keep_rows(self, is_truncated: Tensor | None) -> Tensor:
        """[N] rows that count: those that ended with EOS."""
        if is_truncated is None:
            raise ValueError("mask_truncated=True needs is_truncated (the truncation flags), which is None; "
                             "pass batch.is_truncated, or drop the MaskTruncated term")
        return ~is_truncated.to(torch.bool)


TIS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class TruncatedIS:
    """Surrogate weight against the sampler's log-probs, for samples drawn by another engine or precision
    than the trainer's (vLLM): each token's policy term times a detached importance weight w built from
    r = π_old / π_sampler and the bounds [C_min, C_max] = [``cap_min``, ``cap``] (either may be None: no
    bound on that side; TRL's ``vllm_importance_sampling_mode`` names and its ``_clip_min`` / ``_clip_max``):

    - ``"token_truncate"`` (default): w_t = clamp(r_t, C_min, C_max) (TIS; Yao et al. 2025);
    - ``"token_mask"``: w_t = r_t where C_min <= r_t <= C_max, else 0 (the token leaves the policy term;
      with both bounds this is IcePop, Ring-1T arXiv 2510.18855: M(r) = r on [α, β] = [0.5, 5], see
      :func:`icepop`);
    - ``"sequence_truncate"``: every token of a completion gets clamp(Π_t r_t, C_min, C_max), the ratio of the
      whole sequence (its log the sum over the completion's tokens);
    - ``"sequence_mask"``: Π_t r_t where it lies in [C_min, C_max], else 0 for the whole completion (two-sided
      masked IS, MIS; verl's rollout IS with a lower and an upper threshold).

    Metrics (token means over the step): ``tis_weight`` (w) and ``mismatch/capped_fraction`` (tokens whose
    ratio, or whose sequence's ratio, lay outside the bounds: truncated or masked). The trainer logs how far
    the two engines disagree, ``mismatch/logprob_abs``, whenever the sampler reports its log-probs.
    """

    cap: float | None
    mode: str = "token_truncate"
    cap_min: float | None = None

    def __post_init__(self) -> None:
        if self.cap is None and self.cap_min is None:
            raise ValueError("TruncatedIS needs a bound: tis_cap (C_max) or tis_cap_min (C_min), or both")
        if self.cap is not None and not self.cap > 0:
            raise ValueError(f"tis_cap={self.cap!r} must be > 0; use e.g. 2.0, or None to turn it off")
        if self.cap_min is not None and not 0 <= self.cap_min < (math.inf if self.cap is None else self.cap):
            raise ValueError(f"tis_cap_min={self.cap_min!r} must be >= 0 and < tis_cap={self.cap!r}; "
                             "IcePop uses 0.5 with a cap of 5")
        if self.mode not in TIS_MODES:
            raise ValueError(f"tis_mode={self.mode!r} is not one of {TIS_MODES}; use 'token_truncate'")

    def __str__(self) -> str:  # how errors name it: the setting that made it
        low = "" if self.cap_min is None else f", tis_cap_min={self.cap_min}"
        return f"tis_cap={self.cap}{low}"

    @property
    def requires(self) -> Requirements:
        return Requirements(sampler_logprobs=True, zero_advantage_rows=False)

    def __call__(self, tokens: TokenLoss, batch: MicroBatch) -> TokenLoss:
        sampler = masked(batch.sampler_logprobs.detach(), tokens.mask, tokens.logprobs.dtype)
        log_ratio = torch.where(tokens.mask, tokens.old_logprobs - sampler, torch.zeros_like(sampler))
        if self.mode.startswith("sequence"):  # one ratio per completion, on each of its tokens
            log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(log_ratio)
        ratio = safe_exp(log_ratio)
        low = -math.inf if self.cap_min is None else self.cap_min
        high = math.inf if self.cap is None else self.cap
        over = (ratio > high) | (ratio < low)
        truncate = self.mode.endswith("truncate")
        weight = (ratio.clamp(min=self.cap_min, max=self.cap) if truncate
                  else torch.where(over, torch.zeros_like(ratio), ratio))
        n = tokens.num_valid_tokens
        metrics = {"tis_weight": token_share(weight, tokens.mask, n),
                   "mismatch/capped_fraction": token_share(over.to(weight.dtype), tokens.mask, n)}
        return tokens.replace(policy=tokens.policy * weight, metrics=metrics)


def icepop(low: float = 0.5, high: float = 5.0) -> TruncatedIS:
    """IcePop (Ling team, Ring-1T, arXiv 2510.18855): each token's policy term times
    M(r_t) = r_t if low <= r_t <= high else 0, r_t = π_old / π_sampler: tokens on which the two engines
    disagree too much leave the gradient, the others are importance-weighted. The same as
    ``TruncatedIS(high, "token_mask", low)`` (TRL: ``vllm_importance_sampling_mode="token_mask"`` with
    ``vllm_importance_sampling_clip_min=low``, ``_clip_max=high``); the paper's α = 0.5, β = 5.

    Example:
        >>> icepop()
        TruncatedIS(cap=5.0, mode='token_mask', cap_min=0.5)
    """
    return TruncatedIS(high, "token_mask", low)


@dataclass(frozen=True)
class HighEntropyTokens:
    """Surrogate weight: the policy term only on the valid tokens in the top ``quantile`` fraction by
    (detached) entropy, 0 elsewhere; counts unchanged (metric ``high_entropy_fraction``). The
    threshold is over ``batch.entropy_pool`` when given (under torchrun: this micro-batch of every
    rank), else over this micro-batch's valid tokens."""

    quantile: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile={self.quantile!r} must be in [0, 1] (the fraction of "
                             "tokens kept); the paper uses 0.2, None turns it off")

    def __str__(self) -> str:  # how errors name it: the setting that made it
        return f"top_entropy_quantile={self.quantile}"

    @property
    def requires(self) -> Requirements:  # rows with A = 0 move the quantile: they must be run
        return Requirements(entropy=True, zero_advantage_rows=True, entropy_pool=True)

    def __call__(self, tokens: TokenLoss, batch: MicroBatch) -> TokenLoss:
        high = high_entropy_mask(batch.entropy.detach(), tokens.mask, self.quantile, among=batch.entropy_pool)
        dtype = tokens.logprobs.dtype
        policy = torch.where(high, tokens.policy, torch.zeros((), dtype=dtype, device=high.device))
        fraction = high.sum().to(dtype) / tokens.num_valid_tokens
        return tokens.replace(policy=policy, clipped=tokens.clipped & high,
                              metrics={"high_entropy_fraction": fraction})


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
            raise ValueError(f"kl_estimator={self.estimator!r} is not one of {tuple(KL_ESTIMATORS)}; "
                             "pick one of them")

    def __str__(self) -> str:  # how errors name it: the setting that made it
        return f"kl_coef={self.coef}"

    @property
    def requires(self) -> Requirements:
        return Requirements(ref_logprobs=True, zero_advantage_rows=True)

    def __call__(self, tokens: TokenLoss, batch: MicroBatch) -> TokenLoss:
        kl = kl_tokens(self.estimator, tokens.logprobs, batch.ref_logprobs, tokens.mask)
        share = token_share(kl, tokens.mask, tokens.num_valid_tokens).detach()
        return tokens.replace(penalty=tokens.penalty + self.coef * kl, metrics={"kl": share})


@dataclass(frozen=True)
class RatioWeightedKL:
    """Penalty: ``coef`` · r_t · an estimator k_t of KL(π_θ ‖ π_ref) per token, r_t = π_θ / π_old with its
    gradient (TRL's ``use_bias_correction_kl=True``, after DeepSeek-V3.2, arXiv 2512.02556: samples of
    π_old give the reverse-KL gradient without bias). On-policy r_t is 1 in value but not in gradient:
    ∇(r k) = k ∇log π_θ + ∇k. Metric ``kl``: the token mean of r_t · k_t, as TRL logs it."""

    coef: float
    estimator: str = "k3"

    def __post_init__(self) -> None:
        KLPenalty(self.coef, self.estimator)  # the same checks

    def __str__(self) -> str:  # how errors name it: the setting that made it
        return f"ratio-weighted kl_coef={self.coef}"

    @property
    def requires(self) -> Requirements:
        return Requirements(ref_logprobs=True, zero_advantage_rows=True)

    def __call__(self, tokens: TokenLoss, batch: MicroBatch) -> TokenLoss:
        kl = kl_tokens(self.estimator, tokens.logprobs, batch.ref_logprobs, tokens.mask)
        ratio = safe_exp(tokens.logprobs - tokens.old_logprobs.detach())
        weighted = torch.where(tokens.mask, ratio * kl, torch.zeros_like(kl))
        share = token_share(weighted, tokens.mask, tokens.num_valid_tokens).detach()
        return tokens.replace(penalty=tokens.penalty + self.coef * weighted, metrics={"kl": share})


@dataclass(frozen=True)
class OffPolicySequenceMask:
    """Surrogate weight: DeepSeek-V3.2's off-policy sequence masking (arXiv 2512.02556, §3.1). A completion
    with a negative advantage whose mean per-token log-ratio to the sampling policy exceeds δ leaves the
    policy term:

        M_i = 0  if  A_i < 0  and  (1/|o_i|) Σ_t log(π_μ(o_it) / π_θ(o_it)) > δ,  else 1

    with π_θ detached and π_μ the policy that sampled: the sampler's log-probs when the batch carries
    them (the inference engine, as in the paper), else π_old (``anchor="auto"``, TRL 1.16's
    ``off_policy_mask_threshold`` reading); ``anchor="sampler"`` requires the sampler's, ``"old"`` ignores
    them. The counts are unchanged (the masked tokens still divide), the KL and entropy terms still act;
    an empty completion has log-ratio 0 and is kept. Metric ``off_policy_masked_fraction``: the share of
    valid tokens in masked completions.
    """

    threshold: float
    anchor: str = "auto"

    def __post_init__(self) -> None:
        if not self.threshold >= 0:
            raise ValueError(f"off_policy_mask_threshold={self.threshold!r} must be >= 0 (a mean log-ratio); "
                             "the paper's scale is about 1e-3 to 1, None turns it off")
        if self.anchor not in ("auto", "sampler", "old"):
            raise ValueError(f"anchor={self.anchor!r} is not one of ('auto', 'sampler', 'old'); use 'auto'")

    def __str__(self) -> str:  # how errors name it: the setting that made it
        return f"off_policy_mask_threshold={self.threshold}"

    @property
    def requires(self) -> Requirements:
        return Requirements(sampler_logprobs=self.anchor == "sampler", zero_advantage_rows=False)

    def __call__(self, tokens: TokenLoss, batch: MicroBatch) -> TokenLoss:
        has_sampler = batch.sampler_logprobs is not None
        use_sampler = self.anchor == "sampler" or (self.anchor == "auto" and has_sampler)
        dtype = tokens.logprobs.dtype
        anchor = (masked(batch.sampler_logprobs.detach(), tokens.mask, dtype) if use_sampler
                  else tokens.old_logprobs)
        log_ratio = torch.where(tokens.mask, anchor - tokens.logprobs.detach(), torch.zeros_like(anchor))
        mean = log_ratio.sum(dim=1, keepdim=True) / tokens.mask.sum(dim=1, keepdim=True).clamp(min=1)
        drop = (batch.advantages.detach().to(device=mean.device)[:, None] < 0) & (mean > self.threshold)
        policy = torch.where(drop, torch.zeros_like(tokens.policy), tokens.policy)
        share = token_share(drop.expand_as(tokens.mask).to(dtype), tokens.mask, tokens.num_valid_tokens)
        return tokens.replace(policy=policy, clipped=tokens.clipped & ~drop,
                              metrics={"off_policy_masked_fraction": share})


@dataclass(frozen=True)
class EntropyBonus:
    """Penalty: -``coef`` · the token entropy (with gradient), so higher entropy lowers the loss
    (metric ``entropy``, the token mean)."""

    coef: float

    def __post_init__(self) -> None:
        if not self.coef > 0:
            raise ValueError(f"entropy_coef={self.coef!r} must be > 0 for a bonus; "
                             "drop the term to turn it off")

    def __str__(self) -> str:  # how errors name it: the setting that made it
        return f"entropy_coef={self.coef}"

    @property
    def requires(self) -> Requirements:
        return Requirements(entropy=True, zero_advantage_rows=True)

    def __call__(self, tokens: TokenLoss, batch: MicroBatch) -> TokenLoss:
        entropy = masked(batch.entropy, tokens.mask, tokens.logprobs.dtype)
        share = token_share(entropy, tokens.mask, tokens.num_valid_tokens).detach()
        return tokens.replace(penalty=tokens.penalty - self.coef * entropy, metrics={"entropy": share})
