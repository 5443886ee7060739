"""GMPO: the geometric mean of the clipped token ratios, instead of GRPO's arithmetic mean.

Geometric-Mean Policy Optimization (Zhao et al., arXiv 2507.20673, eq. 4). Per completion i with L_i >= 1
valid tokens (x_it = clamp(logprobs_it - old_it, ±20), the token log-ratio; the clip is in log space):

    c_it = clamp(x_it, -ε_low, ε_high)
    y_it = min(x_it, c_it) if A_i > 0, max(x_it, c_it) if A_i < 0     (PPO's pessimistic side, per token)
    ℓ_i  = -A_i · exp((1/L_i) Σ_t y_it)                               (= -sgn(A_i) Π_t |min(ρ_it A_i,
                                                                         clip(ρ_it) A_i)|^(1/L_i))
    loss = Σ_i [ℓ_i + kl_coef · (1/L_i) Σ_t k(logprobs_it, ref_it)] / N_seq

A clipped token leaves the product's gradient (∂ℓ_i/∂log π_it = -A_i · exp(mean_t y_it) / L_i on the
others), and one outlier ratio moves the geometric mean by only its L_i-th root. Defaults: the paper's range
(e^-0.4, e^0.4). The same as TRL 1.16's ``trl.experimental.gmpo.GMPOTrainer`` (epsilon = 0.4) and verl's
``geo_mean``, KL included (off by default). ``clip_fraction``: valid tokens whose clip is active with
A ≠ 0, over N_tok. An empty row adds 0; truncated rows count like any other; float32 (float64 for float64
inputs); padding never reaches arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from grpo_engine.losses import _common as common
from grpo_engine.losses.aggregation import sequence_mean, sequence_share, token_share
from grpo_engine.losses.terms import kl_tokens
from grpo_engine.types import LossOutput, MicroBatch, Requirements

__all__ = ["GMPO"]


@dataclass(frozen=True)
class GMPO:
    """Geometric-Mean Policy Optimization (token clip in log space, geometric mean per sequence).

    Args:
        clip_eps_low: ε_low >= 0; token log-ratios are clipped below at -ε_low (ratio e^-ε_low).
        clip_eps_high: ε_high >= 0; clipped above at ε_high (ratio e^ε_high).
        kl_coef: β >= 0 on the per-token KL to the reference, averaged per sequence; 0 is off.
        kl_estimator: ``"k3"``, ``"k2"`` or ``"k1"``.

    Example:
        >>> from grpo_engine.types import MicroBatch
        >>> batch = MicroBatch(completion_mask=torch.ones(1, 2, dtype=torch.bool),
        ...                    advantages=torch.tensor([1.0]))
        >>> GMPO()(torch.zeros(1, 2, requires_grad=True), batch, num_valid_tokens=2, num_sequences=1).loss
        tensor(-1., grad_fn=<DivBackward0>)
    """

    clip_eps_low: float = 0.4
    clip_eps_high: float = 0.4
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"

    def __post_init__(self) -> None:
        problems = common.nonnegative(clip_eps_low=self.clip_eps_low, clip_eps_high=self.clip_eps_high,
                                      kl_coef=self.kl_coef)
        problems.extend(common.check_kl_estimator(self.kl_estimator))
        if problems:
            raise ValueError("invalid GMPO: " + "; ".join(problems))

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
                ``ref_logprobs`` when ``kl_coef > 0``). Whole completions only.
            num_valid_tokens, num_sequences: the step's counts (>= 1), from :meth:`counts`.

        Returns:
            ``LossOutput``: the loss and detached step-share metrics ``policy_loss``, ``clip_fraction``
            and, when ``kl_coef > 0``, ``kl``.

        Raises:
            ValueError: counts < 1, mismatched shapes, or missing ``ref_logprobs``.
        """
        common.check_call("GMPO", logprobs, batch, num_valid_tokens, num_sequences, kl_coef=self.kl_coef)
        mask = batch.completion_mask.to(torch.bool)
        logp, old, adv = common.policy_inputs(logprobs, batch, mask)
        log_ratio = (logp - old).clamp(-common.MAX_LOG_RATIO, common.MAX_LOG_RATIO)
        clipped = log_ratio.clamp(-self.clip_eps_low, self.clip_eps_high)
        pessimistic = torch.where(adv > 0, torch.minimum(log_ratio, clipped),
                                  torch.maximum(log_ratio, clipped))
        seq_ratio = torch.exp(sequence_mean(pessimistic, mask))  # [n], 1 for empty rows
        seq_loss = -adv[:, 0] * seq_ratio
        policy_loss = torch.where(mask.any(dim=1), seq_loss, torch.zeros_like(seq_loss)).sum() / num_sequences
        loss, metrics = policy_loss, {}
        if self.kl_coef > 0:
            kl = kl_tokens(self.kl_estimator, logp, batch.ref_logprobs, mask)
            loss = loss + self.kl_coef * sequence_share(kl, mask, num_sequences)
            metrics["kl"] = token_share(kl, mask, num_valid_tokens).detach()
        active = (pessimistic != log_ratio).detach() & (adv != 0) & mask
        metrics["policy_loss"] = policy_loss.detach()
        metrics["clip_fraction"] = active.sum().to(logp.dtype) / num_valid_tokens
        return LossOutput(loss=loss, metrics=metrics)
