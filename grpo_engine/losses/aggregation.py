"""The three ways a loss reduces per-token values [n, C] to a step share (mask m; the counts are
the whole optimizer step's, so summing the shares of a step's micro-batches gives its value):

- ``"sequence"`` (GRPO): Σ_i [Σ_t x_it m_it / Σ_t m_it] / num_sequences
- ``"token"`` (DAPO): Σ_it x_it m_it / num_valid_tokens
- ``"constant"`` (Dr. GRPO): Σ_it x_it m_it / (num_sequences · max_completion_tokens)
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = ["AGGREGATIONS", "Aggregation", "aggregate", "sequence_mean", "sequence_share", "token_share"]

Aggregation = Literal["sequence", "token", "constant"]
AGGREGATIONS: tuple[str, ...] = ("sequence", "token", "constant")


def sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
    """[n] mean of [n, C] ``values`` over each row's valid tokens; 0 for a row without any."""
    values = torch.where(mask, values, torch.zeros_like(values))
    lengths = mask.sum(dim=1).clamp(min=1).to(values.dtype)
    return values.sum(dim=1) / lengths


def sequence_share(values: Tensor, mask: Tensor, num_sequences: int) -> Tensor:
    """Step-share of the mean over sequences of per-sequence token means (seq-mean-token-mean)."""
    return sequence_mean(values, mask).sum() / num_sequences


def token_share(values: Tensor, mask: Tensor, num_valid_tokens: int) -> Tensor:
    """Step-share of the mean over all valid tokens of the step (token-mean)."""
    return torch.where(mask, values, torch.zeros_like(values)).sum() / num_valid_tokens


def aggregate(values: Tensor, mask: Tensor, aggregation: str, *, num_valid_tokens: int, num_sequences: int,
              max_completion_tokens: int | None = None) -> Tensor:
    """The step share of [n, C] ``values`` under ``aggregation`` (see the module docstring).

    Example:
        >>> x, m = torch.tensor([[1.0, 3.0], [2.0, 0.0]]), torch.tensor([[True, True], [True, False]])
        >>> [aggregate(x, m, a, num_valid_tokens=3, num_sequences=2, max_completion_tokens=2).item()
        ...  for a in AGGREGATIONS]
        [2.0, 2.0, 1.5]
    """
    if aggregation == "token":
        return token_share(values, mask, num_valid_tokens)
    if aggregation == "constant":
        return token_share(values, mask, num_sequences * max_completion_tokens)
    return sequence_share(values, mask, num_sequences)
