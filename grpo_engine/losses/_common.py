"""Masked tensor helpers shared by the loss modules (internal; not part of the public API).

Every helper takes a boolean ``mask`` [n, C] (True = the token counts) and never lets a padded
value reach arithmetic: padded positions are replaced by 0 with ``torch.where`` first, so
garbage there (inf, NaN) reaches neither the loss nor the gradient. Reductions return a
step-share: the micro-batch sum divided by a step-global count, so summing the shares of all
micro-batches gives the step value.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_engine.ops.kl import KL_ESTIMATORS
from grpo_engine.types import MicroBatch

__all__ = ["compute_dtype", "masked", "policy_inputs", "ratio_inputs", "safe_exp", "step_counts",
           "nonnegative", "check_kl_estimator", "check_call", "MAX_LOG_RATIO"]

# |log ratio| is clamped here before exp: e^20 ~ 4.9e8, no float32 overflow (e^88.7 is inf)
MAX_LOG_RATIO = 20.0


def safe_exp(log_ratio: Tensor) -> Tensor:
    """exp of ``log_ratio`` clamped to ±``MAX_LOG_RATIO``: finite in float32, and the clamp's zero
    derivative beyond it keeps an overflowing branch from multiplying 0 by inf (NaN) in the backward.

    Example:
        >>> safe_exp(torch.tensor([0.0, 90.0])).isfinite().tolist()
        [True, True]
    """
    return torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def compute_dtype(logprobs: Tensor) -> torch.dtype:
    """float32, or the dtype of ``logprobs`` when it is wider (float64)."""
    return torch.promote_types(logprobs.dtype, torch.float32)


def masked(values: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
    """[n, C] ``values`` in ``dtype`` with 0 where ``mask`` is False (no gradient there)."""
    return torch.where(mask, values.to(dtype), torch.zeros((), dtype=dtype, device=values.device))


def policy_inputs(logprobs: Tensor, batch: MicroBatch, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Masked ``logp`` [n, C] (with gradient), detached ``old`` [n, C] and ``adv`` [n, 1].

    ``old`` is the detached current ``logp`` when ``batch.old_logprobs`` is None (on-policy), so
    the ratio is then exactly 1.
    """
    dtype = compute_dtype(logprobs)
    logp = masked(logprobs, mask, dtype)
    old = logp.detach() if batch.old_logprobs is None else masked(batch.old_logprobs.detach(), mask, dtype)
    adv = batch.advantages.detach().to(dtype)[:, None]
    return logp, old, adv


def ratio_inputs(logprobs: Tensor, batch: MicroBatch, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(logp, ratio, adv)``: as :func:`policy_inputs` with the token ratio exp(logp - old)."""
    logp, old, adv = policy_inputs(logprobs, batch, mask)
    return logp, safe_exp(logp - old), adv


def step_counts(completion_mask: Tensor, keep_rows: Tensor | None = None) -> tuple[int, int]:
    """``(num_valid_tokens, num_sequences)`` of a whole step, counting only ``keep_rows`` [N].

    For the trainer, once per step (it returns Python ints, so it synchronises with the device).
    """
    mask = completion_mask.to(torch.bool)
    if keep_rows is None:
        return int(mask.sum()), int(mask.shape[0])
    keep_rows = keep_rows.to(device=mask.device, dtype=torch.bool)
    return int((mask & keep_rows[:, None]).sum()), int(keep_rows.sum())


def nonnegative(**values: float) -> list[str]:
    """Problems for the named values that are not >= 0 (NaN included)."""
    return [
        f"{name}={value!r} must be >= 0; pass a non-negative number"
        for name, value in values.items()
        if not value >= 0
    ]


def check_kl_estimator(name: str) -> list[str]:
    """Problems with a ``kl_estimator`` field value."""
    if isinstance(name, str) and name in KL_ESTIMATORS:
        return []
    return [f"kl_estimator={name!r} is not one of {tuple(KL_ESTIMATORS)}; pick one of them"]


def check_call(
    owner: str,
    logprobs: Tensor,
    batch: MicroBatch,
    num_valid_tokens: int,
    num_sequences: int,
    *,
    kl_coef: float,
    extra: list[str] | None = None,
) -> None:
    """Raises ValueError naming every bad input of one loss call (``owner`` names the loss)."""
    problems = []
    if num_valid_tokens < 1:
        problems.append(
            f"num_valid_tokens={num_valid_tokens} must be >= 1; pass the step-global count "
            "of True completion-mask entries (skip steps without valid tokens)"
        )
    if num_sequences < 1:
        problems.append(
            f"num_sequences={num_sequences} must be >= 1; pass the step-global completion count"
        )
    shape = tuple(logprobs.shape)
    if logprobs.dim() != 2 or tuple(batch.completion_mask.shape) != shape:
        problems.append(
            f"logprobs shape {shape} must be [n, C] and equal completion_mask shape "
            f"{tuple(batch.completion_mask.shape)}; pass completion-token log-probs only"
        )
    elif tuple(batch.advantages.shape) != shape[:1]:
        problems.append(
            f"advantages shape {tuple(batch.advantages.shape)} must be [n]={shape[:1]}; "
            "pass one advantage per completion"
        )
    for name in ("old_logprobs", "ref_logprobs"):
        other = getattr(batch, name)
        if other is not None and tuple(other.shape) != shape:
            problems.append(
                f"{name} shape {tuple(other.shape)} must equal logprobs shape {shape}; "
                "pass values for the same completion tokens"
            )
    if kl_coef > 0 and batch.ref_logprobs is None:
        problems.append(
            f"kl_coef={kl_coef} needs batch.ref_logprobs, which is None; compute "
            "reference log-probs or set kl_coef=0"
        )
    problems.extend(extra or ())
    if problems:
        raise ValueError(f"{owner}: " + "; ".join(problems))
