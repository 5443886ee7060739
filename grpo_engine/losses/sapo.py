"""SAPO: a soft, temperature-controlled gate on the token ratio instead of the clip.

Soft Adaptive Policy Optimization (Qwen, Gao et al., arXiv 2511.20347). Per valid token t of completion i
(ρ_it = exp(clamp(logprobs_it - old_it, ±20)); τ_i = τ_pos if A_i > 0 else τ_neg; σ the logistic):

    f_it = σ(τ_i · (ρ_it - 1)) · 4 / τ_i
    ℓ_it = -f_it · A_i (+ kl_coef · k(logprobs_it, ref_it))
    loss = aggregate(ℓ)            (default "sequence": (1/N_seq) Σ_i (1/L_i) Σ_t ℓ_it, the paper's)

∂f/∂log π = 4 p (1 - p) ρ with p = σ(τ(ρ - 1)): 1 at ρ = 1 (the plain policy gradient on-policy), falling
smoothly as ρ leaves 1 instead of dropping to 0 at a clip edge. τ_neg > τ_pos (paper: 1.05 and 1.0) damps
negative-advantage tokens faster. TRL 1.16 ``loss_type="sapo"`` computes the same (its ``grpo``
aggregation, no ratio clamp: the two agree while |log ρ| <= 20). Metric ``clip_fraction``: 0 (nothing is
clipped); ``gate_damping``: Σ (1 - 4 p (1 - p)) / N_tok over tokens with A ≠ 0, the share of the gradient the
gate takes away (0 on-policy). Truncated rows count like any other; float32 (float64 for float64 inputs);
padding never reaches arithmetic.
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

__all__ = ["SAPO"]


@dataclass(frozen=True)
class SAPO:
    """Soft Adaptive Policy Optimization: the clip replaced by a sigmoid gate with two temperatures.

    Args:
        temperature_pos: τ_pos > 0 for tokens of completions with A > 0 (paper and TRL: 1.0).
        temperature_neg: τ_neg > 0 for A <= 0 (paper and TRL: 1.05).
        aggregation: ``"sequence"`` (the paper's and TRL's), ``"token"`` or ``"constant"``.
        max_completion_tokens: the constant length of ``"constant"`` aggregation.
        kl_coef: β >= 0 on the per-token KL to the reference policy, aggregated like the loss; 0 is off.
        kl_estimator: ``"k3"``, ``"k2"`` or ``"k1"``.

    Example:
        >>> from grpo_engine.types import MicroBatch
        >>> batch = MicroBatch(completion_mask=torch.ones(1, 2, dtype=torch.bool),
        ...                    advantages=torch.tensor([1.0]))
        >>> SAPO()(torch.zeros(1, 2, requires_grad=True), batch, num_valid_tokens=2, num_sequences=1).loss
        tensor(-2., grad_fn=<DivBackward0>)
    """

    temperature_pos: float = 1.0
    temperature_neg: float = 1.05
    aggregation: Aggregation = "sequence"
    max_completion_tokens: int | None = None
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"

    def __post_init__(self) -> None:
        problems = [f"{name}={value!r} must be > 0; the paper uses 1.0 (pos) and 1.05 (neg)"
                    for name, value in (("temperature_pos", self.temperature_pos),
                                        ("temperature_neg", self.temperature_neg)) if not value > 0]
        problems += common.nonnegative(kl_coef=self.kl_coef) + common.check_kl_estimator(self.kl_estimator)
        if self.aggregation not in AGGREGATIONS:
            problems.append(f"aggregation={self.aggregation!r} is not one of {AGGREGATIONS}; "
                            "pick one of them")
        if self.aggregation == "constant" and not (self.max_completion_tokens or 0) >= 1:
            problems.append("aggregation='constant' divides by max_completion_tokens, which must be >= 1; "
                            "pass the generation limit")
        if problems:
            raise ValueError("invalid SAPO: " + "; ".join(problems))

    @property
    def requires(self) -> Requirements:
        """Reference log-probs when ``kl_coef > 0``; rows with advantage 0 add nothing without a KL."""
        return Requirements(ref_logprobs=self.kl_coef > 0, zero_advantage_rows=self.kl_coef > 0)

    def counts(self, completion_mask: Tensor, is_truncated: Tensor | None = None) -> tuple[int, int]:
        """Step-global ``(num_valid_tokens, num_sequences)``: every valid token, every row."""
        return common.step_counts(completion_mask)

    def __call__(self, logprobs: Tensor, batch: MicroBatch, *, num_valid_tokens: int,
                 num_sequences: int) -> LossOutput:
        """Loss of one micro-batch, already divided by the step-global count.

        Args:
            logprobs: [n, C] log π_θ of the sampled completion tokens, with gradient.
            batch: the micro-batch (``completion_mask``, ``advantages``, ``old_logprobs`` or None,
                ``ref_logprobs`` when ``kl_coef > 0``).
            num_valid_tokens, num_sequences: the step's counts (>= 1), from :meth:`counts`.

        Returns:
            ``LossOutput``: the loss and detached step-share metrics ``policy_loss``, ``clip_fraction``
            (always 0), ``gate_damping`` and, when ``kl_coef > 0``, ``kl``.

        Raises:
            ValueError: counts < 1, mismatched shapes, or missing ``ref_logprobs``.
        """
        common.check_call("SAPO", logprobs, batch, num_valid_tokens, num_sequences, kl_coef=self.kl_coef)
        mask = batch.completion_mask.to(torch.bool)
        logp, ratio, adv = common.ratio_inputs(logprobs, batch, mask)
        tau = torch.where(adv > 0, torch.full_like(adv, self.temperature_pos),
                          torch.full_like(adv, self.temperature_neg))  # [n, 1]
        gate = torch.sigmoid(tau * (ratio - 1.0))
        policy = -gate * (4.0 / tau) * adv  # [n, C]
        counts = dict(num_valid_tokens=num_valid_tokens, num_sequences=num_sequences,
                      max_completion_tokens=self.max_completion_tokens)
        policy_loss = aggregate(policy, mask, self.aggregation, **counts)
        loss, metrics = policy_loss, {}
        if self.kl_coef > 0:
            kl = kl_tokens(self.kl_estimator, logp, batch.ref_logprobs, mask)
            loss = loss + self.kl_coef * aggregate(kl, mask, self.aggregation, **counts)
            metrics["kl"] = token_share(kl, mask, num_valid_tokens).detach()
        damping = torch.where(adv != 0, 1.0 - 4.0 * gate * (1.0 - gate), torch.zeros_like(gate)).detach()
        metrics["policy_loss"] = policy_loss.detach()
        metrics["clip_fraction"] = torch.zeros((), dtype=logp.dtype, device=logp.device)
        metrics["gate_damping"] = token_share(damping, mask, num_valid_tokens)
        return LossOutput(loss=loss, metrics=metrics)
