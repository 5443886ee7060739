"""Schulman's per-token estimators of the reverse KL divergence KL(π_θ ‖ π_ref).

With x sampled from π_θ and log ρ = ``ref_logprobs - logprobs``: k1 = -log ρ (unbiased, can be < 0,
expected gradient 0); k2 = ½ (log ρ)² (biased low, its gradient is the true reverse-KL gradient
on-policy); k3 = ρ - 1 - log ρ (unbiased, >= 0, GRPO's; its expected gradient is the forward KL's).
Values are float32, or the input dtype when wider; k3's exponent is clamped at 20 (no overflow);
callers mask padded positions.
docs/algorithms.md derives the gradients and compares with TRL and verl.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
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
    return torch.expm1(log_ratio.clamp(max=20.0)) - log_ratio  # e^20 at most: no float32 overflow


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
