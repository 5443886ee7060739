"""Per-token estimators of the reverse KL divergence KL(π_θ ‖ π_ref).

Schulman (2020), "Approximating KL divergence" (http://joschu.net/blog/kl-approx.html).
With x sampled from π_θ and log ρ = ``ref_logprobs - logprobs``:

=====  =========================  ==================  ======================================
name   value                      unbiased value?     expected gradient w.r.t. θ
=====  =========================  ==================  ======================================
k1     -log ρ = logp - ref        yes (can be < 0)    0, since E_x[∇ log π_θ(x)] = 0
k2     ½ (log ρ)²                 no (biased low)     ∇ KL(π_θ ‖ π_ref), the true gradient
k3     ρ - 1 - log ρ              yes (always >= 0)   -E_{x~π_ref}[∇ log π_θ(x)], biased
=====  =========================  ==================  ======================================

The gradient column is for the estimator used as a differentiable loss term on on-policy
samples (the sampling distribution itself is not differentiated): only k2 gives the true
reverse-KL gradient; k3's expected gradient is that of the forward KL(π_ref ‖ π_θ).

Why the gradient column holds (x ~ π_θ, expectation of ∇ with the sampling held fixed):

* k1: ∇k1 = ∇log π_θ(x), and E_x~π_θ[∇log π_θ(x)] = Σ_x ∇π_θ(x) = 0.
* k2: ∇k2 = (log π_θ(x) - log π_ref(x)) ∇log π_θ(x), whose expectation is exactly
  ∇ Σ_x π_θ(x) log(π_θ(x)/π_ref(x)) (the score-function form of the reverse-KL gradient).
* k3: ∇k3 = (1 - ρ) ∇log π_θ(x); the "1" term vanishes in expectation and
  -E_x~π_θ[ρ ∇log π_θ] = -Σ_x π_ref(x) ∇log π_θ(x) = ∇ KL(π_ref ‖ π_θ).

GRPO (DeepSeekMath, Shao et al. 2024, arXiv 2402.03300) adds β·k3 per token to the loss (not
to the reward); :class:`grpo_engine.losses.ClippedSurrogate`, ``GSPO`` and ``CISPO`` do the same
with ``kl_coef``, and pick another estimator by name with ``kl_estimator`` (see
:func:`kl_estimator`). TRL 1.16 by default (``use_bias_correction_kl=True``) multiplies k3
by the differentiable token ratio (DeepSeek-V3.2, arXiv 2512.02556): the value is unchanged
on-policy, but the gradient gains k3·∇log π_θ and becomes the unbiased reverse-KL one.
grpo_engine does not weight the KL; use ``"k2"`` for the reverse-KL gradient
(``tests/test_trl_parity.py`` pins the exact difference).

Values are computed in float32, or in the input dtype when it is wider (float64). No clamping
is applied (verl clamps the log-ratio to ±20); callers mask padded positions before use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import Tensor

__all__ = ["KL_ESTIMATORS", "kl_estimator", "kl_k1", "kl_k2", "kl_k3"]

KLEstimator = Callable[[Tensor, Tensor], Tensor]


def _log_ratio(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Returns log ρ = ``ref_logprobs - logprobs`` in float32 or wider, same shape."""
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs shape {tuple(logprobs.shape)} != ref_logprobs shape "
            f"{tuple(ref_logprobs.shape)}; both must be [n, C] for the same tokens"
        )
    dtype = torch.promote_types(logprobs.dtype, ref_logprobs.dtype)
    dtype = torch.promote_types(dtype, torch.float32)
    return ref_logprobs.to(dtype) - logprobs.to(dtype)


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = logp - ref: unbiased, high variance, can be negative; expected gradient 0.

    Args:
        logprobs: [n, C] log π_θ of the sampled tokens.
        ref_logprobs: [n, C] log π_ref of the same tokens.

    Returns:
        [n, C] per-token estimate, float32 or wider.

    Example:
        >>> kl_k1(torch.tensor([0.0]), torch.tensor([-1.0]))
        tensor([1.])
    """
    return -_log_ratio(logprobs, ref_logprobs)


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = ½ (logp - ref)²: biased, low variance, >= 0; gradient is the true reverse-KL one.

    Args:
        logprobs: [n, C] log π_θ of the sampled tokens.
        ref_logprobs: [n, C] log π_ref of the same tokens.

    Returns:
        [n, C] per-token estimate, float32 or wider.

    Example:
        >>> kl_k2(torch.tensor([0.0]), torch.tensor([-2.0]))
        tensor([2.])
    """
    return 0.5 * _log_ratio(logprobs, ref_logprobs).square()


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(ref - logp) - (ref - logp) - 1: unbiased, low variance, >= 0; biased gradient.

    The estimator GRPO (DeepSeekMath) puts in its loss ("low_var_kl" in verl).

    Args:
        logprobs: [n, C] log π_θ of the sampled tokens.
        ref_logprobs: [n, C] log π_ref of the same tokens.

    Returns:
        [n, C] per-token estimate, float32 or wider.

    Example:
        >>> kl_k3(torch.tensor([0.0]), torch.tensor([0.0]))
        tensor([0.])
    """
    log_ratio = _log_ratio(logprobs, ref_logprobs)
    return torch.expm1(log_ratio) - log_ratio


KL_ESTIMATORS: Mapping[str, KLEstimator] = MappingProxyType({"k1": kl_k1, "k2": kl_k2, "k3": kl_k3})
"""Estimator name -> function ``(logprobs [n, C], ref_logprobs [n, C]) -> [n, C]`` (read-only)."""


def kl_estimator(name: str) -> KLEstimator:
    """The per-token KL estimator called ``name``: ``"k1"``, ``"k2"`` or ``"k3"``.

    Args:
        name: one of the keys of :data:`KL_ESTIMATORS`.

    Returns:
        ``fn(logprobs, ref_logprobs)`` giving [n, C] per-token estimates.

    Raises:
        ValueError: for an unknown name, listing the known ones.

    Example:
        >>> kl_estimator("k2")(torch.tensor([0.0]), torch.tensor([-2.0]))
        tensor([2.])
    """
    try:
        return KL_ESTIMATORS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"kl_estimator={name!r} is not one of {tuple(KL_ESTIMATORS)}; pick one of them "
            "(k3 is GRPO's, k2 has the true reverse-KL gradient)"
        ) from None


@dataclass(frozen=True)
class KLRewardPenalty:
    """KL to the reference subtracted from the reward (PPO / RLHF style) instead of added to the loss.

    For each completion i the sequence penalty is ``coef * Σ_t k(logp_old_it, ref_it)`` over its
    kept tokens, with ``logp_old`` the log-probs of the policy that sampled; the trainer
    subtracts it from the completion's total reward *before* advantages are computed, so it
    shapes the advantage rather than the gradient directly (verl's ``compute_rewards``:
    r_t ← r_t − β·(log π_old − log π_ref), summed here because GRPO's reward is per completion).
    The default estimator is k1 as in PPO; k3 gives a non-negative penalty.

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

    def __call__(self, old_logprobs: Tensor, ref_logprobs: Tensor, completion_mask: Tensor) -> Tensor:
        """[N] penalties from [N, C] log-probs and mask."""
        per_token = kl_estimator(self.estimator)(old_logprobs, ref_logprobs)
        return self.coef * torch.where(completion_mask, per_token, torch.zeros_like(per_token)).sum(dim=1)
