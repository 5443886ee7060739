"""DPPO: PPO's ratio clip replaced by a binary trust-region mask on a direct divergence estimate.

Divergence Proximal Policy Optimization (Qi et al., "Rethinking the Trust Region in LLM Reinforcement
Learning", arXiv 2602.04879, the Binary-TV and Binary-KL variants). Per valid token t of completion i, with
μ the anchor policy (``anchor="old"``: π_old; ``"sampler"``: the sampler's own log-probs, the paper's
rollout policy), p = π_θ(o_it), q = μ(o_it), ρ_it = exp(clamp(log p - log q, ±20)):

    D_it = |p - q|                                             (divergence="tv": TV of {o_it, the rest})
    D_it = q log(q/p) + (1 - q) log((1 - q)/(1 - p))           (divergence="kl": KL(μ‖π_θ), same two points)
    M_it = 0 if (A_i > 0 and ρ_it > 1 and D_it > δ_high) or (A_i < 0 and ρ_it < 1 and D_it > δ_low), else 1
    ℓ_it = -sg[M_it] · ρ_it · A_i (+ kl_coef · k(logprobs_it, ref_it))
    loss = aggregate(ℓ)                                         (default "token": Σ_it m_it ℓ_it / N_tok)

A token is dropped only when its probability has left the trust region in the direction its advantage
pushes (PPO's asymmetry); a rare token may move by a large ratio as long as its probability moves little.
The ratio is not truncated (the paper finds truncated IS hurts; verl's ``dppo_tv`` / ``dppo_kl`` use
-A·sg[min(ρ, 20)]·log π, the same gradient while ρ <= 20). δ defaults to 0.2 each, verl's (no value from
the paper is assumed). ``clip_fraction``: valid tokens masked with A ≠ 0, over N_tok. Truncated rows count
like any other; float32 (float64 for float64 inputs); padding never reaches arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from grpo_engine.losses import _common as common
from grpo_engine.losses.aggregation import AGGREGATIONS, Aggregation, aggregate, token_share
from grpo_engine.losses.terms import kl_tokens
from grpo_engine.types import LossOutput, MicroBatch, Requirements

__all__ = ["DPPO"]

_DIVERGENCES = ("tv", "kl")
_ANCHORS = ("old", "sampler")


def binary_divergence(logp: Tensor, anchor: Tensor, kind: str) -> Tensor:
    """[n, C] detached binary TV or KL(μ‖π) between the two-point distributions {token, rest} of π (``logp``)
    and μ (``anchor``); +inf where π gives the token probability 1 and μ does not (KL)."""
    logp, anchor = logp.detach(), anchor.detach()
    p, q = logp.exp(), anchor.exp()
    if kind == "tv":
        return (p - q).abs()
    log_rest_p, log_rest_q = torch.log1p(-p), torch.log1p(-q)  # log(1 - p), -inf at p = 1
    rest = torch.where(q < 1, (1 - q) * (log_rest_q - log_rest_p), torch.zeros_like(q))
    return q * (anchor - logp) + rest


@dataclass(frozen=True)
class DPPO:
    """Divergence PPO: the ratio surrogate, masked where the token's divergence leaves the trust region.

    Args:
        divergence: ``"tv"`` (DPPO-Binary-TV) or ``"kl"`` (DPPO-Binary-KL).
        delta_low: δ >= 0 for tokens with A < 0 (their probability falling).
        delta_high: δ >= 0 for tokens with A > 0 (their probability rising).
        anchor: ``"old"`` (π_old) or ``"sampler"`` (``batch.sampler_logprobs``, the rollout policy).
        aggregation: ``"token"`` (verl's and prime-rl's), ``"sequence"`` or ``"constant"``.
        max_completion_tokens: the constant length of ``"constant"`` aggregation.
        kl_coef: β >= 0 on the per-token KL to the reference, aggregated like the loss; 0 is off.
        kl_estimator: ``"k3"``, ``"k2"`` or ``"k1"``.

    Example:
        >>> from grpo_engine.types import MicroBatch
        >>> batch = MicroBatch(completion_mask=torch.ones(1, 2, dtype=torch.bool),
        ...                    advantages=torch.tensor([1.0]))
        >>> DPPO()(torch.zeros(1, 2, requires_grad=True), batch, num_valid_tokens=2, num_sequences=1).loss
        tensor(-1., grad_fn=<DivBackward0>)
    """

    divergence: Literal["tv", "kl"] = "tv"
    delta_low: float = 0.2
    delta_high: float = 0.2
    anchor: Literal["old", "sampler"] = "old"
    aggregation: Aggregation = "token"
    max_completion_tokens: int | None = None
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"

    def __post_init__(self) -> None:
        problems = common.nonnegative(delta_low=self.delta_low, delta_high=self.delta_high,
                                      kl_coef=self.kl_coef)
        problems.extend(common.check_kl_estimator(self.kl_estimator))
        for name, value, allowed in (("divergence", self.divergence, _DIVERGENCES),
                                     ("anchor", self.anchor, _ANCHORS),
                                     ("aggregation", self.aggregation, AGGREGATIONS)):
            if value not in allowed:
                problems.append(f"{name}={value!r} is not one of {allowed}; pick one of them")
        if self.aggregation == "constant" and not (self.max_completion_tokens or 0) >= 1:
            problems.append("aggregation='constant' divides by max_completion_tokens, which must be >= 1; "
                            "pass the generation limit")
        if problems:
            raise ValueError("invalid DPPO: " + "; ".join(problems))

    @property
    def requires(self) -> Requirements:
        """Reference log-probs when ``kl_coef > 0``, the sampler's log-probs with ``anchor="sampler"``; rows
        with advantage 0 add nothing without a KL."""
        return Requirements(ref_logprobs=self.kl_coef > 0, sampler_logprobs=self.anchor == "sampler",
                            zero_advantage_rows=self.kl_coef > 0)

    def counts(self, completion_mask: Tensor, is_truncated: Tensor | None = None) -> tuple[int, int]:
        """Step-global ``(num_valid_tokens, num_sequences)``: every valid token, every row."""
        return common.step_counts(completion_mask)

    def __call__(self, logprobs: Tensor, batch: MicroBatch, *, num_valid_tokens: int,
                 num_sequences: int) -> LossOutput:
        """Loss of one micro-batch, already divided by the step-global count.

        Args:
            logprobs: [n, C] log π_θ of the sampled completion tokens, with gradient.
            batch: the micro-batch (``completion_mask``, ``advantages``, ``old_logprobs`` or None, or
                ``sampler_logprobs`` with ``anchor="sampler"``; ``ref_logprobs`` when ``kl_coef > 0``).
            num_valid_tokens, num_sequences: the step's counts (>= 1), from :meth:`counts`.

        Returns:
            ``LossOutput``: the loss and detached step-share metrics ``policy_loss``, ``clip_fraction``
            (masked tokens) and, when ``kl_coef > 0``, ``kl``.

        Raises:
            ValueError: counts < 1, mismatched shapes, or a missing input.
        """
        extra = [f"anchor='sampler' {p}" for p in self.requires.missing(batch, tuple(logprobs.shape))
                 if "sampler_logprobs" in p]
        common.check_call("DPPO", logprobs, batch, num_valid_tokens, num_sequences, kl_coef=self.kl_coef,
                          extra=extra)
        mask = batch.completion_mask.to(torch.bool)
        logp, old, adv = common.policy_inputs(logprobs, batch, mask)
        if self.anchor == "sampler":
            old = common.masked(batch.sampler_logprobs.detach(), mask, logp.dtype)
        ratio = common.safe_exp(logp - old)
        div = binary_divergence(logp, old, self.divergence)
        rising, falling = (ratio > 1).detach(), (ratio < 1).detach()
        outside = torch.where(adv > 0, rising & (div > self.delta_high), falling & (div > self.delta_low))
        outside = outside & (adv != 0) & mask
        policy = torch.where(outside, torch.zeros_like(ratio), -ratio * adv)
        counts = dict(num_valid_tokens=num_valid_tokens, num_sequences=num_sequences,
                      max_completion_tokens=self.max_completion_tokens)
        policy_loss = aggregate(policy, mask, self.aggregation, **counts)
        loss, metrics = policy_loss, {}
        if self.kl_coef > 0:
            kl = kl_tokens(self.kl_estimator, logp, batch.ref_logprobs, mask)
            loss = loss + self.kl_coef * aggregate(kl, mask, self.aggregation, **counts)
            metrics["kl"] = token_share(kl, mask, num_valid_tokens).detach()
        metrics["policy_loss"] = policy_loss.detach()
        metrics["clip_fraction"] = outside.sum().to(logp.dtype) / num_valid_tokens
        return LossOutput(loss=loss, metrics=metrics)
