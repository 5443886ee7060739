"""Reductions of per-token values [n, C] under a boolean mask (True = a valid token).

:func:`token_entropy_mean` (token mean, or a step-share with a step-global count),
:func:`group_token_entropy` (per prompt group, [N, C] -> [B]) and :func:`high_entropy_mask` (the
valid tokens at or above the ``1 - ρ`` quantile of entropy, "Beyond the 80/20 rule", arXiv
2506.01939, linear interpolation as ``torch.quantile``). Pure; padded values never reach arithmetic.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["token_entropy_mean", "group_token_entropy", "high_entropy_mask", "valid_values", "pooled_values"]


def _masked(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``values`` as float (at least float32) with 0 on padding, and the boolean mask."""
    mask = mask.to(device=values.device, dtype=torch.bool)
    dtype = torch.promote_types(values.dtype, torch.float32)
    return torch.where(mask, values.to(dtype), torch.zeros((), dtype=dtype, device=values.device)), mask


def valid_values(values: Tensor, mask: Tensor) -> Tensor:
    """[k] the detached values at the valid positions, as float (at least float32), in row order.

    Example:
        >>> valid_values(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[True, False], [True, True]]))
        tensor([1., 3., 4.])
    """
    values, mask = _masked(values.detach(), mask)
    return values[mask]


def pooled_values(values: Tensor, mask: Tensor) -> Tensor:
    """[n * C] the detached values as float (at least float32), +inf at the positions that are not valid:
    a pool of fixed size (:func:`high_entropy_mask`'s ``among`` leaves the +inf out), where
    :func:`valid_values` has one entry per valid position and so a size only the data knows (on a GPU, a
    read back to the host).

    Example:
        >>> pooled_values(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[True, False], [True, True]]))
        tensor([1., inf, 3., 4.])
    """
    values, mask = _masked(values.detach(), mask)
    return torch.where(mask, values, torch.full((), float("inf"), dtype=values.dtype,
                                                device=values.device)).flatten()


def _check_shapes(name: str, entropy: Tensor, mask: Tensor) -> None:
    if entropy.dim() != 2 or tuple(mask.shape) != tuple(entropy.shape):
        raise ValueError(f"{name}: entropy shape {tuple(entropy.shape)} must be [n, C] and equal the mask "
                         f"shape {tuple(mask.shape)}; pass one entropy per completion token")


def token_entropy_mean(entropy: Tensor, mask: Tensor, num_valid_tokens: int | None = None) -> Tensor:
    """Mean token entropy over the valid tokens (0 when there are none).

    Args:
        entropy: [n, C] per-token entropy (nats); padding may hold anything.
        mask: [n, C] True on valid completion tokens.
        num_valid_tokens: when given, divide by this step-global count instead of the local one,
            so that the values of a step's micro-batches sum to the step mean (the loss-metric
            convention of ``LossOutput``).

    Returns:
        A detached scalar (float32, or float64 for float64 input).

    Example:
        >>> token_entropy_mean(torch.tensor([[1.0, 3.0], [2.0, float("nan")]]),
        ...                    torch.tensor([[True, True], [True, False]]))
        tensor(2.)
    """
    _check_shapes("token_entropy_mean", entropy, mask)
    if num_valid_tokens is not None and not num_valid_tokens >= 1:
        raise ValueError(f"token_entropy_mean: num_valid_tokens={num_valid_tokens!r} must be >= 1; pass the "
                         "step-global count of valid tokens (or None for the local mean)")
    values, mask = _masked(entropy.detach(), mask)
    if num_valid_tokens is not None:
        return values.sum() / num_valid_tokens
    return values.sum() / mask.sum().clamp(min=1).to(values.dtype)


def group_token_entropy(entropy: Tensor, mask: Tensor, group_size: int) -> Tensor:
    """Per-prompt mean token entropy: the token mean over all valid tokens of each group.

    Rows ``b * G .. b * G + G - 1`` form group ``b`` (the ``RolloutBatch`` row order). Every valid
    token of the group weighs the same (a long completion counts more than a short one); a group
    without valid tokens gets 0.

    Args:
        entropy: [N, C] per-token entropy, N = B * G.
        mask: [N, C] True on valid completion tokens.
        group_size: G >= 1.

    Returns:
        [B] detached float tensor.

    Example:
        >>> ent = torch.tensor([[1.0, 1.0], [4.0, 0.0], [0.5, 0.5], [0.0, 0.0]])
        >>> mask = torch.tensor([[True, True], [True, False], [True, True], [False, False]])
        >>> group_token_entropy(ent, mask, group_size=2)
        tensor([2.0000, 0.5000])
    """
    _check_shapes("group_token_entropy", entropy, mask)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_token_entropy: group_size={group_size!r} must be an int >= 1 (G)")
    if entropy.shape[0] % group_size:
        raise ValueError(f"group_token_entropy: {entropy.shape[0]} rows are not a whole number of groups of "
                         f"group_size={group_size}; pass N = B * G rows in RolloutBatch order")
    values, mask = _masked(entropy.detach(), mask)
    sums = values.reshape(-1, group_size * values.shape[1]).sum(dim=1)  # [B]
    counts = mask.reshape(-1, group_size * mask.shape[1]).sum(dim=1).clamp(min=1)  # [B]
    return sums / counts.to(values.dtype)


def high_entropy_mask(entropy: Tensor, mask: Tensor, top_entropy_quantile: float, *,
                      among: Tensor | None = None) -> Tensor:
    """True on the valid tokens whose entropy is in the top ``top_entropy_quantile`` fraction.

    The threshold is ``torch.quantile(H[mask], 1 - top_entropy_quantile)`` (linear interpolation
    between order statistics), and a token is kept when ``H >= threshold``: exactly TRL 1.16's
    ``get_high_entropy_mask(entropies, mask, 1 - top_entropy_quantile)`` on one process. With
    ties at the threshold more than the fraction can be kept; ``top_entropy_quantile=1`` keeps
    every valid token; ``0`` keeps only the maximum (and its ties). The input is detached: the
    mask carries no gradient. The quantile is taken in the input's precision (at least float32);
    TRL always takes it in float32, so for float64 input the two can differ at a tie.

    Args:
        entropy: [n, C] per-token entropy; padding may hold anything.
        mask: [n, C] True on valid tokens.
        top_entropy_quantile: ρ in [0, 1], the fraction to keep (the paper uses 0.2).
        among: 1-D entropies to take the threshold over instead of ``H[mask]``, e.g. the valid
            tokens of this micro-batch on every rank (``pooled_values``, gathered); they must
            include this micro-batch's own; +inf entries (no token) are left out.

    Returns:
        [n, C] bool, False on padding; all False when no token is valid.

    Example:
        >>> ent = torch.tensor([[0.1, 2.0, 0.3, 0.2, 1.5]])
        >>> high_entropy_mask(ent, torch.ones(1, 5, dtype=torch.bool), 0.4)
        tensor([[False,  True, False, False,  True]])
    """
    _check_shapes("high_entropy_mask", entropy, mask)
    if not 0.0 <= top_entropy_quantile <= 1.0:
        raise ValueError(f"high_entropy_mask: top_entropy_quantile={top_entropy_quantile!r} "
                         "must be in [0, 1] (the fraction of tokens to keep; the paper uses 0.2)")
    values, mask = _masked(entropy.detach(), mask)
    pool = pooled_values(values, mask) if among is None else among.detach().to(values.device, values.dtype)
    # the valid values first, ascending, then +inf; their count k stays on the device (no read back)
    valid = pool.sort().values
    k = torch.isfinite(valid).sum()
    # torch.quantile's linear rule, spelled out (torch.quantile refuses inputs above 2**24 elements);
    # with k = 0 the threshold is +inf and no token is kept
    rank = (k - 1).clamp(min=0).to(valid.dtype) * (1.0 - top_entropy_quantile)
    below, above = rank.long(), rank.ceil().long()
    if valid.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.lerp(valid.gather(0, below[None]), valid.gather(0, above[None]), rank - below)
    return (values >= threshold) & mask
