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

GRPO (DeepSeekMath, Shao et al. 2024, arXiv 2402.03300) adds β·k3 per token to the loss (not
to the reward); :class:`grpo_engine.losses.ClippedSurrogate` does the same with ``kl_coef``.

Values are computed in float32, or in the input dtype when it is wider (float64). No clamping
is applied (verl clamps the log-ratio to ±20); callers mask padded positions before use.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["kl_k1", "kl_k2", "kl_k3"]


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
