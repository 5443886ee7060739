"""LUSPO: GSPO with each sequence's loss scaled by its length, which removes GSPO's length bias.

Length-Unbiased Sequence Policy Optimization (Liu et al., Meituan, arXiv 2602.05261). Per completion i
(mask m, L_i = Σ_t m_it; the sequence ratio is GSPO's, arXiv 2507.18071):

    s_i  = exp(clamp((1/L_i) Σ_t m_it (logprobs_it - old_it), ±20))
    ℓ_i  = -min(s_i · A_i, clip(s_i, 1 - ε_low, 1 + ε_high) · A_i)
    loss = Σ_i [L_i · ℓ_i + kl_coef · Σ_t m_it k(logprobs_it, ref_it)] / N_seq

GSPO's sequence mean gives every completion the same weight, so the gradient per token of a long
completion is 1/L_i of a short one's and lengths collapse; the factor L_i makes each token count the same
(∂/∂log π_it = -A_i s_i / N_seq where unclipped). The same as TRL 1.16's ``loss_type="luspo"`` with
``importance_sampling_level="sequence"`` (KL included: its per-token KL, summed per completion, no ratio
weight); the clip defaults are GSPO's (3e-4, 4e-4). ``clip_fraction``: the share of the step's sequences
whose clip is the active minimum. Truncated rows count like any other; float32 (float64 for float64
inputs); padding never reaches arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from grpo_engine.losses import _common as common
from grpo_engine.losses.aggregation import sequence_mean, token_share
from grpo_engine.losses.terms import kl_tokens
from grpo_engine.types import LossOutput, MicroBatch, Requirements

__all__ = ["LUSPO"]


@dataclass(frozen=True)
class LUSPO:
    """Length-Unbiased Sequence Policy Optimization (GSPO's clipped sequence ratio, times the length).

    Args:
        clip_eps_low: ε_low >= 0; s_i is clipped below at 1 - ε_low.
        clip_eps_high: ε_high >= 0; s_i is clipped above at 1 + ε_high.
        kl_coef: β >= 0 on the per-token KL to the reference, summed per completion; 0 is off.
        kl_estimator: ``"k3"``, ``"k2"`` or ``"k1"``.

    Example:
        >>> from grpo_engine.types import MicroBatch
        >>> batch = MicroBatch(completion_mask=torch.ones(1, 2, dtype=torch.bool),
        ...                    advantages=torch.tensor([1.0]))
        >>> LUSPO()(torch.zeros(1, 2, requires_grad=True), batch, num_valid_tokens=2, num_sequences=1).loss
        tensor(-2., grad_fn=<DivBackward0>)
    """

    clip_eps_low: float = 3e-4
    clip_eps_high: float = 4e-4
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"

    def __post_init__(self) -> None:
        problems = common.nonnegative(clip_eps_low=self.clip_eps_low, clip_eps_high=self.clip_eps_high,
                                      kl_coef=self.kl_coef)
        problems.extend(common.check_kl_estimator(self.kl_estimator))
        if problems:
            raise ValueError("invalid LUSPO: " + "; ".join(problems))

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
        common.check_call("LUSPO", logprobs, batch, num_valid_tokens, num_sequences, kl_coef=self.kl_coef)
        mask = batch.completion_mask.to(torch.bool)
        logp, old, adv = common.policy_inputs(logprobs, batch, mask)
        lengths = mask.sum(dim=1).to(logp.dtype)  # [n], 0 for empty rows
        ratio = common.safe_exp(sequence_mean(logp - old, mask))  # [n]
        clipped_ratio = ratio.clamp(1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high)
        unclipped_obj, clipped_obj = ratio * adv[:, 0], clipped_ratio * adv[:, 0]
        seq_loss = -torch.minimum(unclipped_obj, clipped_obj) * lengths  # 0 for empty rows
        policy_loss = seq_loss.sum() / num_sequences
        loss, metrics = policy_loss, {}
        if self.kl_coef > 0:
            kl = kl_tokens(self.kl_estimator, logp, batch.ref_logprobs, mask)
            loss = loss + self.kl_coef * kl.sum() / num_sequences
            metrics["kl"] = token_share(kl, mask, num_valid_tokens).detach()
        clipped = (clipped_obj < unclipped_obj) & mask.any(dim=1)
        metrics["policy_loss"] = policy_loss.detach()
        metrics["clip_fraction"] = clipped.sum().to(logp.dtype) / num_sequences
        return LossOutput(loss=loss, metrics=metrics)
