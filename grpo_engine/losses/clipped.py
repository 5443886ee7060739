"""The PPO-style clipped token surrogate of GRPO, DAPO and Dr. GRPO.

Per valid token t of completion i (``logprobs`` with gradient, ``old``/``ref`` without):

    ratio_it = exp(logprobs_it - old_it)
    ℓ_it     = -min(ratio_it · A_i, clip(ratio_it, 1 - clip_eps_low, 1 + clip_eps_high) · A_i)
               + kl_coef · k3(logprobs_it, ref_it)

* Clip: two-sided on the token ratio, asymmetric when ``clip_eps_high != clip_eps_low``
  ("Clip-Higher", DAPO, Yu et al. 2025, arXiv 2503.14476, uses 0.2 / 0.28).
* Old policy: ``batch.old_logprobs``, or the detached current ``logprobs`` when None (one
  update per batch, μ = 1): the ratio is then exactly 1 and ∇ℓ = -A ∇ log π_θ.
* KL: Schulman's k3 estimator of KL(π_θ ‖ π_ref) added to the per-token loss (not to the
  reward), as in GRPO (DeepSeekMath, Shao et al. 2024, arXiv 2402.03300); off when
  ``kl_coef`` is 0 (the default, as in DAPO and Dr. GRPO).
* Aggregation over the mask m (counts are for the whole optimizer step, so summing the
  micro-batch losses gives the loss of the step):

  - ``"sequence"`` (GRPO): Σ_i [Σ_t ℓ_it m_it / Σ_t m_it] / num_sequences
  - ``"token"`` (DAPO): Σ_it ℓ_it m_it / num_valid_tokens
  - ``"constant"`` (Dr. GRPO, Liu et al. 2025, arXiv 2503.20783, as TRL's ``dr_grpo``):
    Σ_it ℓ_it m_it / (num_sequences · max_completion_tokens)

* Truncated completions are treated like any other; mask them upstream to drop them.
* Advantages arrive precomputed (see :mod:`grpo_engine.advantages`), one per completion.

Computation is in float32 (or float64 for float64 inputs). Padded positions are replaced
before any arithmetic, so garbage there (inf, NaN) never reaches the loss or the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from grpo_engine.losses.kl import kl_k3
from grpo_engine.types import LossOutput, MicroBatch

__all__ = ["ClippedSurrogate"]

Aggregation = Literal["sequence", "token", "constant"]
_AGGREGATIONS = ("sequence", "token", "constant")


def _masked(values: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
    """[n, C] ``values`` in ``dtype`` with 0 where ``mask`` is False (no gradient there)."""
    return torch.where(mask, values.to(dtype), torch.zeros((), dtype=dtype, device=values.device))


@dataclass(frozen=True)
class ClippedSurrogate:
    """Clipped token surrogate with optional k3 KL and a choice of aggregation.

    Args:
        clip_eps_low: ε_low >= 0; the ratio is clipped below at 1 - ε_low.
        clip_eps_high: ε_high >= 0; clipped above at 1 + ε_high. None means ε_low.
        kl_coef: β >= 0 on the per-token k3 KL to the reference policy; 0 disables it.
        aggregation: ``"sequence"`` (GRPO), ``"token"`` (DAPO) or ``"constant"`` (Dr. GRPO).
        max_completion_tokens: the constant length of ``"constant"`` aggregation (required
            there, ignored otherwise).

    Example:
        >>> from grpo_engine.types import MicroBatch
        >>> loss_fn = ClippedSurrogate(aggregation="token")
        >>> batch = MicroBatch(completion_mask=torch.ones(1, 2, dtype=torch.bool),
        ...                    advantages=torch.tensor([1.0]))
        >>> out = loss_fn(torch.zeros(1, 2, requires_grad=True), batch,
        ...               num_valid_tokens=2, num_sequences=1)
        >>> out.loss
        tensor(-1., grad_fn=<DivBackward0>)
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float | None = None
    kl_coef: float = 0.0
    aggregation: Aggregation = "sequence"
    max_completion_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.clip_eps_high is None:
            object.__setattr__(self, "clip_eps_high", self.clip_eps_low)
        problems = []
        for name in ("clip_eps_low", "clip_eps_high", "kl_coef"):
            value = getattr(self, name)
            if not value >= 0:  # also rejects NaN
                problems.append(f"{name}={value!r} must be >= 0; pass a non-negative number")
        if self.aggregation not in _AGGREGATIONS:
            problems.append(
                f"aggregation={self.aggregation!r} is not one of {_AGGREGATIONS}; pick one of them"
            )
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            problems.append(
                f"max_completion_tokens={self.max_completion_tokens!r} must be >= 1; "
                "pass the generation limit"
            )
        if self.aggregation == "constant" and self.max_completion_tokens is None:
            problems.append(
                "aggregation='constant' divides by max_completion_tokens, which is None; "
                "pass max_completion_tokens (the generation limit)"
            )
        if problems:
            raise ValueError("invalid ClippedSurrogate: " + "; ".join(problems))

    @property
    def requires_ref_logprobs(self) -> bool:
        """True when ``kl_coef > 0``: the trainer must supply ``batch.ref_logprobs``."""
        return self.kl_coef > 0

    @property
    def needs_zero_advantage_rows(self) -> bool:
        """False when ``kl_coef == 0``: a completion with advantage 0 then adds exactly 0 to the
        loss, the gradient and every metric, so the trainer may skip its forward and backward."""
        return self.kl_coef > 0

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
            batch: the micro-batch; its ``completion_mask`` [n, C], ``advantages`` [n],
                ``old_logprobs`` [n, C] or None, and ``ref_logprobs`` [n, C] (when
                ``kl_coef > 0``) are used. ``old``/``ref`` are detached.
            num_valid_tokens: True entries of the completion mask over the whole step (>= 1).
            num_sequences: completions in the whole step (>= 1).

        Returns:
            ``LossOutput`` with the scalar loss and detached metrics, each a step-level share
            (sum over micro-batches): ``policy_loss`` (the surrogate part, same aggregation),
            ``clip_fraction`` (valid tokens where the clipped term is the active minimum)
            and, when ``kl_coef > 0``, ``kl`` (token mean of k3). Rows with advantage 0
            contribute 0 to every metric when ``kl_coef == 0``, so a trainer that skips them
            (see ``needs_zero_advantage_rows``) still reports exact step values.

        Raises:
            ValueError: for counts < 1, mismatched shapes, or missing ``ref_logprobs`` when
                ``kl_coef > 0``.
        """
        self._check(logprobs, batch, num_valid_tokens, num_sequences)
        mask = batch.completion_mask.to(torch.bool)
        dtype = torch.promote_types(logprobs.dtype, torch.float32)
        logp = _masked(logprobs, mask, dtype)
        if batch.old_logprobs is None:
            old = logp.detach()
        else:
            old = _masked(batch.old_logprobs.detach(), mask, dtype)
        adv = batch.advantages.detach().to(dtype)[:, None]  # [n, 1]

        ratio = torch.exp(logp - old)
        clipped_ratio = ratio.clamp(1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high)
        unclipped_obj, clipped_obj = ratio * adv, clipped_ratio * adv
        policy_token = -torch.minimum(unclipped_obj, clipped_obj)  # [n, C]
        token_loss = policy_token
        metrics: dict[str, Tensor] = {}
        if self.kl_coef > 0:
            kl = kl_k3(logp, _masked(batch.ref_logprobs.detach(), mask, dtype))
            token_loss = token_loss + self.kl_coef * kl
            metrics["kl"] = self._token_mean(kl, mask, num_valid_tokens).detach()

        loss = self._aggregate(token_loss, mask, num_valid_tokens, num_sequences)
        is_clipped = (clipped_obj < unclipped_obj) & mask
        policy_loss = self._aggregate(policy_token, mask, num_valid_tokens, num_sequences)
        metrics["policy_loss"] = policy_loss.detach()
        metrics["clip_fraction"] = is_clipped.sum().to(dtype) / num_valid_tokens
        return LossOutput(loss=loss, metrics=metrics)

    def _check(
        self, logprobs: Tensor, batch: MicroBatch, num_valid_tokens: int, num_sequences: int
    ) -> None:
        """Raises ValueError naming every bad input of one call."""
        problems = []
        if num_valid_tokens < 1:
            problems.append(
                f"num_valid_tokens={num_valid_tokens} must be >= 1; pass the step-global count "
                "of True completion-mask entries (skip steps without valid tokens)"
            )
        if num_sequences < 1:
            problems.append(
                f"num_sequences={num_sequences} must be >= 1; pass the step-global completion count"
            )
        shape = tuple(logprobs.shape)
        if logprobs.dim() != 2 or tuple(batch.completion_mask.shape) != shape:
            problems.append(
                f"logprobs shape {shape} must be [n, C] and equal completion_mask shape "
                f"{tuple(batch.completion_mask.shape)}; pass completion-token log-probs only"
            )
        elif tuple(batch.advantages.shape) != shape[:1]:
            problems.append(
                f"advantages shape {tuple(batch.advantages.shape)} must be [n]={shape[:1]}; "
                "pass one advantage per completion"
            )
        for name in ("old_logprobs", "ref_logprobs"):
            other = getattr(batch, name)
            if other is not None and tuple(other.shape) != shape:
                problems.append(
                    f"{name} shape {tuple(other.shape)} must equal logprobs shape {shape}; "
                    "pass values for the same completion tokens"
                )
        if self.kl_coef > 0 and batch.ref_logprobs is None:
            problems.append(
                f"kl_coef={self.kl_coef} needs batch.ref_logprobs, which is None; compute "
                "reference log-probs or set kl_coef=0"
            )
        if problems:
            raise ValueError("ClippedSurrogate: " + "; ".join(problems))

    def _aggregate(
        self, token_loss: Tensor, mask: Tensor, num_valid_tokens: int, num_sequences: int
    ) -> Tensor:
        """Reduces [n, C] per-token values (0 on padding) to the step-share scalar."""
        token_loss = torch.where(mask, token_loss, torch.zeros_like(token_loss))
        if self.aggregation == "token":
            return token_loss.sum() / num_valid_tokens
        if self.aggregation == "constant":
            return token_loss.sum() / (num_sequences * self.max_completion_tokens)
        lengths = mask.sum(dim=1).clamp(min=1).to(token_loss.dtype)  # [n]; empty rows sum to 0
        return (token_loss.sum(dim=1) / lengths).sum() / num_sequences

    @staticmethod
    def _token_mean(values: Tensor, mask: Tensor, num_valid_tokens: int) -> Tensor:
        """Step-share of the token mean of [n, C] ``values`` over valid tokens."""
        return torch.where(mask, values, torch.zeros_like(values)).sum() / num_valid_tokens
