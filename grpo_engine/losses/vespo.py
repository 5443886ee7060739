"""VESPO: REINFORCE weighted by a Gamma-shaped kernel of the whole sequence's importance ratio.

Variational Sequence-level Soft Policy Optimization (Shen et al., Xiaohongshu, arXiv 2602.10693; its
pseudocode, App. I). Per completion i (mask m; the ratio is the product over the sequence, no length
normalisation), with (k, λ) = (k_pos, λ_pos) if A_i >= 0 else (k_neg, λ_neg):

    log W_i = clamp(Σ_t m_it · clamp(logprobs_it - old_it, ±20), log 1e-8, 20)
    φ_i     = W_i^k · exp(λ · (1 - W_i))                      (φ(1) = 1; computed as exp(λ + k log W - λ W))
    ℓ_it    = -sg[φ_i] · A_i · logprobs_it (+ kl_coef · k(logprobs_it, ref_it))
    loss    = aggregate(ℓ)                                     (default "token": Σ_it m_it ℓ_it / N_tok)

φ rises as W^k below 1 and decays as e^(-λW) above it: stale or mismatched sequences are damped smoothly,
separately for positive and negative advantages (paper: (k, λ) = (2, 3) and (3, 2)). On-policy W = 1 and
this is token-mean REINFORCE; the loss value is not an objective estimate, its gradient is. The clamps are
the paper code's and TRL's, and this equals TRL 1.16's ``loss_type="vespo"`` (``vespo_k_pos`` ...), whose
aggregation is the token mean. Samples from another engine: ``tis_cap`` = C folds the sampler's token ratio
r_t = π_old/π_sampler into W as the paper's code and TRL (vLLM importance sampling) do, log W_i +=
Σ_t m_it · clamp(log r'_t, log 1e-8, 20) with r'_t = min(r_t, C) (``tis_mode="token_truncate"``) or r_t, 0
above C (``"token_mask"``); W is then π_θ/π_sampler. ``clip_fraction``: 0; ``vespo_damping``:
Σ |1 - φ_i| / N_tok over tokens with A ≠ 0, how far the kernel moves the gradient's weight from 1 (0
on-policy). Truncated rows count like any other; float32 (float64 for float64 inputs); padding never
reaches arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from grpo_engine.losses import _common as common
from grpo_engine.losses.aggregation import AGGREGATIONS, Aggregation, aggregate, token_share
from grpo_engine.losses.terms import kl_tokens
from grpo_engine.types import LossOutput, MicroBatch, Requirements

__all__ = ["VESPO"]

_LOG_W_MIN = math.log(1e-8)  # the paper code's floor on the sequence ratio (TRL's too)
_TIS_MODES = ("token_truncate", "token_mask")


@dataclass(frozen=True)
class VESPO:
    """Variational Sequence-level Soft Policy Optimization (Gamma-weighted sequence REINFORCE).

    Args:
        k_pos: k >= 0, the power of W for completions with A >= 0 (paper and TRL: 2).
        lambda_pos: λ > 0, the decay in W for A >= 0 (paper and TRL: 3).
        k_neg: k >= 0 for A < 0 (paper and TRL: 3).
        lambda_neg: λ > 0 for A < 0 (paper and TRL: 2).
        aggregation: ``"token"`` (the paper code's default and TRL's), ``"sequence"`` or ``"constant"``.
        max_completion_tokens: the constant length of ``"constant"`` aggregation.
        kl_coef: β >= 0 on the per-token KL to the reference, aggregated like the loss; 0 is off.
        kl_estimator: ``"k3"``, ``"k2"`` or ``"k1"``.
        tis_cap: C > 0: fold the sampler's token ratio, truncated or masked at C, into W (needs
            ``batch.sampler_logprobs``); None (default): W is π_θ/π_old.
        tis_mode: ``"token_truncate"`` or ``"token_mask"`` (TRL's names; its only modes for VESPO).

    Example:
        >>> from grpo_engine.types import MicroBatch
        >>> batch = MicroBatch(completion_mask=torch.ones(1, 2, dtype=torch.bool),
        ...                    advantages=torch.tensor([1.0]))
        >>> VESPO()(torch.full((1, 2), -0.5, requires_grad=True), batch, num_valid_tokens=2,
        ...         num_sequences=1).loss
        tensor(0.5000, grad_fn=<DivBackward0>)
    """

    k_pos: float = 2.0
    lambda_pos: float = 3.0
    k_neg: float = 3.0
    lambda_neg: float = 2.0
    aggregation: Aggregation = "token"
    max_completion_tokens: int | None = None
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    tis_cap: float | None = None
    tis_mode: Literal["token_truncate", "token_mask"] = "token_truncate"

    def __post_init__(self) -> None:
        problems = common.nonnegative(k_pos=self.k_pos, k_neg=self.k_neg, kl_coef=self.kl_coef)
        if self.tis_cap is not None and not self.tis_cap > 0:
            problems.append(f"tis_cap={self.tis_cap!r} must be > 0; use e.g. 3.0, or None to turn it off")
        if self.tis_mode not in _TIS_MODES:
            problems.append(f"tis_mode={self.tis_mode!r} is not one of {_TIS_MODES}; VESPO's W is already a "
                            "sequence ratio, so only token modes fold into it")
        problems += [f"{name}={value!r} must be > 0; the paper uses 3 (pos) and 2 (neg)"
                     for name, value in (("lambda_pos", self.lambda_pos), ("lambda_neg", self.lambda_neg))
                     if not value > 0]
        problems.extend(common.check_kl_estimator(self.kl_estimator))
        if self.aggregation not in AGGREGATIONS:
            problems.append(f"aggregation={self.aggregation!r} is not one of {AGGREGATIONS}; "
                            "pick one of them")
        if self.aggregation == "constant" and not (self.max_completion_tokens or 0) >= 1:
            problems.append("aggregation='constant' divides by max_completion_tokens, which must be >= 1; "
                            "pass the generation limit")
        if problems:
            raise ValueError("invalid VESPO: " + "; ".join(problems))

    @property
    def requires(self) -> Requirements:
        """Reference log-probs when ``kl_coef > 0``, the sampler's with ``tis_cap``; rows with advantage 0 add
        nothing without a KL."""
        return Requirements(ref_logprobs=self.kl_coef > 0, sampler_logprobs=self.tis_cap is not None,
                            zero_advantage_rows=self.kl_coef > 0)

    def counts(self, completion_mask: Tensor, is_truncated: Tensor | None = None) -> tuple[int, int]:
        """Step-global ``(num_valid_tokens, num_sequences)``: every valid token, every row."""
        return common.step_counts(completion_mask)

    def weights(self, logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, sampler: Tensor | None = None
                ) -> Tensor:
        """[n, 1] detached φ_i from masked [n, C] ``logp``, ``old`` (and ``sampler`` with ``tis_cap``) and
        [n, 1] ``adv``."""
        log_ratio = (logp - old).detach().clamp(-common.MAX_LOG_RATIO, common.MAX_LOG_RATIO)
        if self.tis_cap is not None:  # log r' with r = π_old/π_sampler truncated or masked at the cap
            log_is, log_cap = old - sampler, math.log(self.tis_cap)
            log_is = (log_is.clamp(max=log_cap) if self.tis_mode == "token_truncate"
                      else torch.where(log_is > log_cap, torch.full_like(log_is, _LOG_W_MIN), log_is))
            log_ratio = log_ratio + log_is.clamp(_LOG_W_MIN, common.MAX_LOG_RATIO)
        log_w = torch.where(mask, log_ratio, torch.zeros_like(log_ratio)).sum(dim=1, keepdim=True)
        log_w = log_w.clamp(_LOG_W_MIN, common.MAX_LOG_RATIO)
        positive = adv >= 0
        k = torch.where(positive, torch.full_like(adv, self.k_pos), torch.full_like(adv, self.k_neg))
        lam = torch.where(positive, torch.full_like(adv, self.lambda_pos),
                          torch.full_like(adv, self.lambda_neg))
        return torch.exp(lam + k * log_w - lam * torch.exp(log_w))

    def __call__(self, logprobs: Tensor, batch: MicroBatch, *, num_valid_tokens: int,
                 num_sequences: int) -> LossOutput:
        """Loss of one micro-batch, already divided by the step-global count.

        Args:
            logprobs: [n, C] log π_θ of the sampled completion tokens, with gradient.
            batch: the micro-batch (``completion_mask``, ``advantages``, ``old_logprobs`` or None,
                ``ref_logprobs`` when ``kl_coef > 0``, ``sampler_logprobs`` with ``tis_cap``). Whole
                completions only: W_i needs all of a row.
            num_valid_tokens, num_sequences: the step's counts (>= 1), from :meth:`counts`.

        Returns:
            ``LossOutput``: the loss and detached step-share metrics ``policy_loss``, ``clip_fraction``
            (always 0), ``vespo_damping`` and, when ``kl_coef > 0``, ``kl``.

        Raises:
            ValueError: counts < 1, mismatched shapes, or missing ``ref_logprobs``.
        """
        extra = [f"tis_cap={self.tis_cap} {p}" for p in self.requires.missing(batch, tuple(logprobs.shape))
                 if "sampler_logprobs" in p]
        common.check_call("VESPO", logprobs, batch, num_valid_tokens, num_sequences, kl_coef=self.kl_coef,
                          extra=extra)
        mask = batch.completion_mask.to(torch.bool)
        logp, old, adv = common.policy_inputs(logprobs, batch, mask)
        sampler = (None if self.tis_cap is None
                   else common.masked(batch.sampler_logprobs.detach(), mask, logp.dtype))
        phi = self.weights(logp, old, adv, mask, sampler)  # [n, 1]
        policy = -phi * adv * logp
        counts = dict(num_valid_tokens=num_valid_tokens, num_sequences=num_sequences,
                      max_completion_tokens=self.max_completion_tokens)
        policy_loss = aggregate(policy, mask, self.aggregation, **counts)
        loss, metrics = policy_loss, {}
        if self.kl_coef > 0:
            kl = kl_tokens(self.kl_estimator, logp, batch.ref_logprobs, mask)
            loss = loss + self.kl_coef * aggregate(kl, mask, self.aggregation, **counts)
            metrics["kl"] = token_share(kl, mask, num_valid_tokens).detach()
        metrics["policy_loss"] = policy_loss.detach()
        metrics["clip_fraction"] = torch.zeros((), dtype=logp.dtype, device=logp.device)
        damping = torch.where(adv != 0, (1.0 - phi).abs(), torch.zeros_like(phi)).expand_as(logp)
        metrics["vespo_damping"] = token_share(damping, mask, num_valid_tokens)
        return LossOutput(loss=loss, metrics=metrics)
