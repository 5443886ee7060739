"""CISPO: REINFORCE on every token, weighted by a clipped, stop-gradient importance weight.

Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv 2506.13585, eqs. 4-5). Per valid token t of
completion i (mask m; k the ``kl_estimator``):

    w_it = sg(clip(exp(logprobs_it - old_it), 1 - clip_eps_low, 1 + clip_eps_high))
    loss = Σ_it m_it · (-w_it · A_i · logprobs_it + kl_coef · k(logprobs_it, ref_it)) / num_valid_tokens

The clip acts on the weight, not on the surrogate, so every token keeps its gradient -w_it A_i ∇log π_θ.
``clip_eps_low=None`` (the default) means no lower bound; the cap is 1 + ``clip_eps_high`` (default 4.0,
a cap of 5). Old policy: ``batch.old_logprobs``, or the detached current log-probs, which make every
weight exactly 1 (token-mean REINFORCE); the loss value is not an objective estimate, its gradient is.
Aggregation: the step's token mean, KL included (off by default). ``clip_fraction``: valid tokens with a
clipped weight (either bound) and A ≠ 0, over ``num_valid_tokens``. Truncated rows count like any other;
float32 (float64 for float64 inputs); padding never reaches arithmetic. TRL and verl: docs/algorithms.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from grpo_engine.losses import _common as common
from grpo_engine.losses.aggregation import token_share
from grpo_engine.losses.terms import kl_tokens
from grpo_engine.types import LossOutput, MicroBatch, Requirements

__all__ = ["CISPO"]


@dataclass(frozen=True)
class CISPO:
    """Clipped IS-weight Policy Optimization (token-mean REINFORCE with a capped weight).

    Args:
        clip_eps_low: ε_low >= 0, weights are clipped below at 1 - ε_low; None: no lower bound.
        clip_eps_high: ε_high >= 0, weights are capped at 1 + ε_high (default 4.0: cap 5).
        kl_coef: β >= 0 on the per-token KL to the reference policy; 0 disables it.
        kl_estimator: ``"k3"``, ``"k2"`` or ``"k1"`` (see :mod:`grpo_engine.ops.kl`).

    Example:
        >>> from grpo_engine.types import MicroBatch
        >>> batch = MicroBatch(completion_mask=torch.ones(1, 2, dtype=torch.bool),
        ...                    advantages=torch.tensor([1.0]))
        >>> CISPO()(torch.full((1, 2), -0.5, requires_grad=True), batch,
        ...         num_valid_tokens=2, num_sequences=1).loss
        tensor(0.5000, grad_fn=<DivBackward0>)
    """

    clip_eps_low: float | None = None
    clip_eps_high: float = 4.0
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"

    def __post_init__(self) -> None:
        values = dict(clip_eps_high=self.clip_eps_high, kl_coef=self.kl_coef)
        if self.clip_eps_low is not None:
            values["clip_eps_low"] = self.clip_eps_low
        problems = common.nonnegative(**values)
        problems.extend(common.check_kl_estimator(self.kl_estimator))
        if problems:
            raise ValueError("invalid CISPO: " + "; ".join(problems))

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
        """Loss of one micro-batch, already divided by the step-global token count.

        Args:
            logprobs: [n, C] log π_θ of the sampled completion tokens, with gradient.
            batch: the micro-batch (``completion_mask``, ``advantages``, ``old_logprobs`` or
                None, ``ref_logprobs`` when ``kl_coef > 0``).
            num_valid_tokens: valid tokens over the whole step (>= 1).
            num_sequences: completions in the whole step (>= 1; only checked).

        Returns:
            ``LossOutput`` with the loss and detached step-share metrics: ``policy_loss``,
            ``clip_fraction`` and, when ``kl_coef > 0``, ``kl`` (token mean of the estimator).

        Raises:
            ValueError: for counts < 1, mismatched shapes, or missing ``ref_logprobs``.
        """
        common.check_call("CISPO", logprobs, batch, num_valid_tokens, num_sequences, kl_coef=self.kl_coef)
        mask = batch.completion_mask.to(torch.bool)
        logp, ratio, adv = common.ratio_inputs(logprobs, batch, mask)
        ratio = ratio.detach()
        low = None if self.clip_eps_low is None else 1.0 - self.clip_eps_low
        high = 1.0 + self.clip_eps_high
        weight = ratio.clamp(min=low, max=high)
        is_clipped = (ratio > high) if low is None else (ratio > high) | (ratio < low)
        policy_token = -weight * adv * logp  # [n, C]
        policy_loss = token_share(policy_token, mask, num_valid_tokens)
        loss = policy_loss
        metrics: dict[str, Tensor] = {}
        if self.kl_coef > 0:
            kl = kl_tokens(self.kl_estimator, logp, batch.ref_logprobs, mask)
            loss = loss + self.kl_coef * token_share(kl, mask, num_valid_tokens)
            metrics["kl"] = token_share(kl, mask, num_valid_tokens).detach()
        metrics["policy_loss"] = policy_loss.detach()
        clipped = is_clipped & (adv != 0) & mask
        metrics["clip_fraction"] = clipped.sum().to(logp.dtype) / num_valid_tokens
        return LossOutput(loss=loss, metrics=metrics)
