"""Clip-Cov and KL-Cov: loss terms against entropy collapse (Cui et al., "The Entropy Mechanism of
Reinforcement Learning for Reasoning Language Models", arXiv 2505.22617).

The entropy of the policy falls fastest through tokens whose log-probability and advantage move together.
Per valid token of the micro-batch (A_it = A_i; the means over its valid tokens, log π detached):

    Cov_it = (A_it - mean A) · (log π_θ(o_it) - mean log π_θ)

- :class:`ClipCov`: among the valid tokens the PPO clip has not already cut whose Cov lies in (ω_low, ω_high)
  (paper: 1 and 5), ``max(1, ⌊r · N⌋)`` chosen at random (r = 2e-4, N the micro-batch's valid tokens) lose
  their policy term, value and gradient (paper eq. 9; verl ``clip_cov``).
- :class:`KLCov`: the ``max(1, ⌊k · N⌋)`` valid tokens of largest Cov get the penalty
  β · |log π_θ - log π_old| (paper eq. 10: k = 2e-4, β = 1; verl ``kl_cov``). The paper's and verl's
  surrogate under KL-Cov is unclipped: ``ClippedSurrogate(clip_eps_low=1.0, clip_eps_high=1e9, ...)``.

Both are :class:`~grpo_engine.protocols.LossTerm` objects for ``ClippedSurrogate(terms=...)`` or its
``clip_cov_ratio`` / ``kl_cov_ratio`` keywords. The statistics are over the micro-batch, as in verl (so they
change with the micro-batch size), and choosing the tokens reads their count on the host (one device sync
per micro-batch, as in verl); ClipCov draws from torch's global generator. TRL 1.16 has neither.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_engine.losses.aggregation import token_share
from grpo_engine.types import MicroBatch, Requirements, TokenLoss

__all__ = ["ClipCov", "KLCov", "token_covariance"]


def token_covariance(logprobs: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """[n, C] (A_i - mean A) · (log π_it - mean log π) over the valid tokens (detached), -inf on padding.

    Example:
        >>> logprobs = torch.tensor([[0.0, -2.0], [-3.0, -1.0]])
        >>> mask = torch.tensor([[True, True], [True, False]])
        >>> token_covariance(logprobs, torch.tensor([1.0, -1.0]), mask)  # means over 3 tokens: 1/3 and -5/3
        tensor([[ 1.1111, -0.2222],
                [ 1.7778,    -inf]])
    """
    logp = torch.where(mask, logprobs.detach(), torch.zeros_like(logprobs))
    adv = advantages.detach().to(device=logp.device, dtype=logp.dtype)[:, None].expand_as(logp)
    count = mask.sum().clamp(min=1)
    mean_adv = torch.where(mask, adv, torch.zeros_like(adv)).sum() / count
    mean_logp = logp.sum() / count
    cov = (adv - mean_adv) * (logp - mean_logp)
    return torch.where(mask, cov, torch.full_like(cov, -torch.inf))


def _how_many(ratio: float, mask: Tensor) -> int:
    return max(1, int(ratio * int(mask.sum())))  # int(): the host needs the count (verl's .item() too)


def _check(name: str, ratio: float, coef: float | None = None) -> None:
    if not 0 < ratio <= 1:
        raise ValueError(f"{name}={ratio!r} must be in (0, 1] (the fraction of tokens); the paper uses 2e-4")
    if coef is not None and not coef > 0:
        raise ValueError(f"kl_cov_coef={coef!r} must be > 0; the paper uses 1.0")


@dataclass(frozen=True)
class ClipCov:
    """Surrogate weight: a random ``ratio`` share of the unclipped tokens with Cov in (``low``, ``high``)
    loses its policy term (metric ``clip_cov_fraction``: the share of valid tokens cut)."""

    ratio: float = 2e-4
    low: float = 1.0
    high: float = 5.0

    def __post_init__(self) -> None:
        _check("clip_cov_ratio", self.ratio)
        if not self.low < self.high:
            raise ValueError(f"ClipCov: low={self.low!r} must be < high={self.high!r}; "
                             "the paper uses 1 and 5")

    def __str__(self) -> str:  # how errors name it: the setting that made it
        return f"clip_cov_ratio={self.ratio}"

    @property
    def requires(self) -> Requirements:  # rows with A = 0 move the means
        return Requirements(zero_advantage_rows=True)

    def __call__(self, tokens: TokenLoss, batch: MicroBatch) -> TokenLoss:
        cov = token_covariance(tokens.logprobs, batch.advantages, tokens.mask)
        candidates = torch.nonzero(tokens.mask & ~tokens.clipped & (cov > self.low) & (cov < self.high))
        order = torch.randperm(len(candidates), device=cov.device)
        pick = candidates[order[:_how_many(self.ratio, tokens.mask)]]
        cut = torch.zeros_like(tokens.mask)
        cut[pick[:, 0], pick[:, 1]] = True
        policy = torch.where(cut, torch.zeros_like(tokens.policy), tokens.policy)
        share = token_share(cut.to(policy.dtype), tokens.mask, tokens.num_valid_tokens)
        return tokens.replace(policy=policy, clipped=tokens.clipped | cut,
                              metrics={"clip_cov_fraction": share})


@dataclass(frozen=True)
class KLCov:
    """Penalty: β · |log π_θ - log π_old| on the top ``ratio`` share of valid tokens by Cov (metric
    ``kl_cov_fraction``: the share of valid tokens penalised)."""

    ratio: float = 2e-4
    coef: float = 1.0

    def __post_init__(self) -> None:
        _check("kl_cov_ratio", self.ratio, self.coef)

    def __str__(self) -> str:  # how errors name it: the setting that made it
        return f"kl_cov_ratio={self.ratio}"

    @property
    def requires(self) -> Requirements:  # rows with A = 0 move the means
        return Requirements(zero_advantage_rows=True)

    def __call__(self, tokens: TokenLoss, batch: MicroBatch) -> TokenLoss:
        cov = token_covariance(tokens.logprobs, batch.advantages, tokens.mask).flatten()
        top = torch.topk(cov, min(_how_many(self.ratio, tokens.mask), int(tokens.mask.sum()))).indices
        chosen = torch.zeros_like(cov, dtype=torch.bool)
        chosen[top] = True
        chosen = chosen.view_as(tokens.mask) & tokens.mask
        gap = (tokens.logprobs - tokens.old_logprobs).abs()
        penalty = torch.where(chosen, self.coef * gap, torch.zeros_like(gap))
        share = token_share(chosen.to(gap.dtype), tokens.mask, tokens.num_valid_tokens)
        return tokens.replace(penalty=tokens.penalty + penalty, metrics={"kl_cov_fraction": share})
