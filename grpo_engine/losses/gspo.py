"""GSPO: the clipped surrogate on a sequence-level importance ratio.

Group Sequence Policy Optimization (Qwen, arXiv 2507.18071). Per completion i (mask m, |o_i| = Σ_t m_it):

    s_i  = exp( Σ_t m_it (logprobs_it - old_it) / |o_i| )      (geometric mean of token ratios, eq. 7)
    ℓ_i  = -min(s_i · A_i, clip(s_i, 1 - clip_eps_low, 1 + clip_eps_high) · A_i)
    loss = Σ_i [ℓ_i + kl_coef · mean_t k(logprobs_it, ref_it)] / num_sequences

A whole sequence is clipped or kept; the log-ratio is not clamped; the defaults are the paper's tiny
range, ε_low = 3e-4 and ε_high = 4e-4 (§5.1). Old policy: ``batch.old_logprobs``, or the detached current
log-probs: s_i is then exactly 1 and ∇ℓ_i = -A_i ∇ mean_t log π_θ, so GSPO differs from GRPO only
off-policy. ``level="token"`` is GSPO-token (eq. 13): s_it = sg[s_i] · exp(logprobs_it - sg[logprobs_it]),
clipped per token, seq-mean-token-mean; with one advantage per completion its value, clip and gradient
are exactly ``"sequence"``'s. KL: off by default (β = 0 in the paper), not weighted by s_i. Truncated
rows count like any other. float32 (float64 for float64 inputs); padding never reaches arithmetic.
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

__all__ = ["GSPO"]

_LEVELS = ("sequence", "token")


@dataclass(frozen=True)
class GSPO:
    """Group Sequence Policy Optimization (sequence ratio, sequence clip, sequence mean).

    Args:
        clip_eps_low: ε_low >= 0; s_i is clipped below at 1 - ε_low.
        clip_eps_high: ε_high >= 0; s_i is clipped above at 1 + ε_high.
        kl_coef: β >= 0 on the per-token KL to the reference policy; 0 disables it.
        kl_estimator: ``"k3"``, ``"k2"`` or ``"k1"`` (see :mod:`grpo_engine.ops.kl`).
        level: ``"sequence"`` (GSPO) or ``"token"`` (GSPO-token; same value and gradient here).

    Example:
        >>> from grpo_engine.types import MicroBatch
        >>> batch = MicroBatch(completion_mask=torch.ones(1, 2, dtype=torch.bool),
        ...                    advantages=torch.tensor([1.0]))
        >>> GSPO()(torch.zeros(1, 2, requires_grad=True), batch,
        ...        num_valid_tokens=2, num_sequences=1).loss
        tensor(-1., grad_fn=<DivBackward0>)
    """

    clip_eps_low: float = 3e-4
    clip_eps_high: float = 4e-4
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    level: Literal["sequence", "token"] = "sequence"

    def __post_init__(self) -> None:
        problems = common.nonnegative(clip_eps_low=self.clip_eps_low, clip_eps_high=self.clip_eps_high,
                                      kl_coef=self.kl_coef)
        problems.extend(common.check_kl_estimator(self.kl_estimator))
        if self.level not in _LEVELS:
            problems.append(f"level={self.level!r} is not one of {_LEVELS}; pick one of them")
        if problems:
            raise ValueError("invalid GSPO: " + "; ".join(problems))

    @property
    def requires(self) -> Requirements:
        """Reference log-probs when ``kl_coef > 0``; rows with advantage 0 add nothing without a KL."""
        return Requirements(ref_logprobs=self.kl_coef > 0, zero_advantage_rows=self.kl_coef > 0)

    def counts(self, completion_mask: Tensor, is_truncated: Tensor | None = None) -> tuple[int, int]:
        """Step-global ``(num_valid_tokens, num_sequences)``: every valid token, every row."""
        return common.step_counts(completion_mask)

    def __call__(
        self,
        logprobs: Tensor,
        batch: MicroBatch,
        *,
        num_valid_tokens: int,
        num_sequences: int,
    ) -> LossOutput:
        """Loss of one micro-batch, already divided by the step-global count.

        Args:
            logprobs: [n, C] log π_θ of the sampled completion tokens, with gradient.
            batch: the micro-batch (``completion_mask``, ``advantages``, ``old_logprobs`` or
                None, ``ref_logprobs`` when ``kl_coef > 0``). Whole completions only: a
                sequence ratio needs all of a row's tokens in one call.
            num_valid_tokens: valid tokens over the whole step (>= 1; used by the ``kl`` metric).
            num_sequences: completions in the whole step (>= 1).

        Returns:
            ``LossOutput`` with the loss and detached step-share metrics: ``policy_loss``,
            ``clip_fraction`` (fraction of the step's sequences whose clip is the active
            minimum) and, when ``kl_coef > 0``, ``kl`` (token mean of the estimator).

        Raises:
            ValueError: for counts < 1, mismatched shapes, or missing ``ref_logprobs``.
        """
        common.check_call("GSPO", logprobs, batch, num_valid_tokens, num_sequences, kl_coef=self.kl_coef)
        mask = batch.completion_mask.to(torch.bool)
        logp, old, adv = common.policy_inputs(logprobs, batch, mask)
        has_tokens = mask.any(dim=1)  # [n]
        log_seq_ratio = sequence_mean(logp - old, mask)  # [n], 0 for empty rows
        if self.level == "sequence":
            ratio = common.safe_exp(log_seq_ratio)[:, None]  # [n, 1]
        else:
            ratio = common.safe_exp(logp - logp.detach() + log_seq_ratio.detach()[:, None])  # [n, C]
        clipped_ratio = ratio.clamp(1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high)
        unclipped_obj, clipped_obj = ratio * adv, clipped_ratio * adv
        surrogate = -torch.minimum(unclipped_obj, clipped_obj)
        if self.level == "sequence":
            seq_loss = torch.where(has_tokens, surrogate[:, 0], torch.zeros_like(surrogate[:, 0]))
            seq_clipped = (clipped_obj < unclipped_obj)[:, 0] & has_tokens
        else:  # every token of a row has the same ratio, so the same loss and clip state
            seq_loss = sequence_mean(surrogate, mask)
            seq_clipped = ((clipped_obj < unclipped_obj) & mask).any(dim=1)
        policy_loss = seq_loss.sum() / num_sequences
        loss = policy_loss
        metrics: dict[str, Tensor] = {}
        if self.kl_coef > 0:
            kl = kl_tokens(self.kl_estimator, logp, batch.ref_logprobs, mask)
            loss = loss + self.kl_coef * sequence_share(kl, mask, num_sequences)
            metrics["kl"] = token_share(kl, mask, num_valid_tokens).detach()
        metrics["policy_loss"] = policy_loss.detach()
        metrics["clip_fraction"] = seq_clipped.sum().to(logp.dtype) / num_sequences
        return LossOutput(loss=loss, metrics=metrics)
