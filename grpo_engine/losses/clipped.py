"""The PPO-style clipped token surrogate of GRPO, DAPO and Dr. GRPO, with composable terms.

Per valid token t of completion i, with ratio_it = exp(clamp(logprobs_it - old_it, ±20)) (old: the
detached current log-probs when ``batch.old_logprobs`` is None, so the ratio is exactly 1 on-policy):

    policy_it = -min(min(ratio_it, δ) · A_i, clip(ratio_it, 1 - ε_low, 1 + ε_high) · A_i)
    loss      = aggregate(policy · weights + penalties)           (losses/aggregation.py)

The clip is asymmetric when ε_high != ε_low ("Clip-Higher", DAPO, arXiv 2503.14476); δ (off by
default) caps the unclipped ratio (INTELLECT-2, arXiv 2505.07291). The terms (losses/terms.py):
token filters (``mask_truncated``), surrogate weights (``tis_cap``, ``top_entropy_quantile``) and
per-token penalties (``kl_coef``: k3 KL to the reference as in GRPO, arXiv 2402.03300;
``entropy_coef``: entropy bonus), given as keyword arguments or as ``terms``. Computation is in
float32 (float64 for float64 inputs); padded positions never reach arithmetic. docs/algorithms.md
compares it with TRL and verl.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from grpo_engine.losses import _common as common
from grpo_engine.losses.aggregation import AGGREGATIONS, Aggregation, aggregate
from grpo_engine.losses.terms import EntropyBonus, HighEntropyTokens, KLPenalty, MaskTruncated, TruncatedIS
from grpo_engine.types import LossOutput, MicroBatch, Requirements

__all__ = ["ClippedSurrogate"]

_FILTERS, _WEIGHTS, _PENALTIES = (MaskTruncated,), (TruncatedIS, HighEntropyTokens), (KLPenalty, EntropyBonus)


@dataclass(frozen=True)
class ClippedSurrogate:
    """Clipped token surrogate with optional KL, δ cap, entropy bonus, importance weights and filters.

    Args:
        clip_eps_low: ε_low >= 0; the ratio is clipped below at 1 - ε_low.
        clip_eps_high: ε_high >= 0; clipped above at 1 + ε_high. None means ε_low.
        kl_coef: β >= 0 on the per-token KL to the reference policy (a :class:`KLPenalty`); 0 is off.
        aggregation: ``"sequence"`` (GRPO), ``"token"`` (DAPO) or ``"constant"`` (Dr. GRPO).
        max_completion_tokens: the constant length of ``"constant"`` aggregation (required there).
        delta: INTELLECT-2's cap δ > 1 + ε_high on the ratio of the unclipped term; None is off.
        kl_estimator: ``"k3"`` (GRPO), ``"k2"`` or ``"k1"``; used when ``kl_coef > 0``.
        mask_truncated: drop completions without EOS (a :class:`MaskTruncated` term).
        entropy_coef: >= 0, the entropy bonus (an :class:`EntropyBonus` term); 0 is off.
        tis_cap: cap of the truncated importance weight π_old / π_sampler (a :class:`TruncatedIS`).
        top_entropy_quantile: ρ in [0, 1]: the policy term on the top-ρ entropy tokens only
            (a :class:`HighEntropyTokens` term); None is off.
        terms: further terms, composed after those the keyword arguments make.

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
    delta: float | None = None
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    mask_truncated: bool = False
    entropy_coef: float = 0.0
    tis_cap: float | None = None
    top_entropy_quantile: float | None = None
    terms: tuple[Any, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.clip_eps_high is None:
            object.__setattr__(self, "clip_eps_high", self.clip_eps_low)
        problems = common.nonnegative(clip_eps_low=self.clip_eps_low, clip_eps_high=self.clip_eps_high,
                                      kl_coef=self.kl_coef, entropy_coef=self.entropy_coef)
        if self.aggregation not in AGGREGATIONS:
            problems.append(f"aggregation={self.aggregation!r} is not one of {AGGREGATIONS}; pick one of them")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            problems.append(f"max_completion_tokens={self.max_completion_tokens!r} must be >= 1; pass the "
                            "generation limit")
        if self.aggregation == "constant" and self.max_completion_tokens is None:
            problems.append("aggregation='constant' divides by max_completion_tokens, which is None; pass "
                            "max_completion_tokens (the generation limit)")
        if self.delta is not None and not self.delta > 1 + self.clip_eps_high:
            problems.append(f"delta={self.delta!r} must be > 1 + clip_eps_high = {1 + self.clip_eps_high}; pass a "
                            "larger cap (INTELLECT-2 uses 4) or None")
        problems.extend(common.check_kl_estimator(self.kl_estimator))
        terms: list[Any] = []
        try:
            terms += [MaskTruncated()] if self.mask_truncated else []
            terms += [TruncatedIS(self.tis_cap)] if self.tis_cap is not None else []
            terms += [HighEntropyTokens(self.top_entropy_quantile)] if self.top_entropy_quantile is not None else []
            terms += [KLPenalty(self.kl_coef, self.kl_estimator)] if self.kl_coef > 0 and not problems else []
            terms += [EntropyBonus(self.entropy_coef)] if self.entropy_coef > 0 else []
        except ValueError as error:
            problems.append(str(error))
        unknown = [t for t in self.terms if not isinstance(t, _FILTERS + _WEIGHTS + _PENALTIES)]
        if unknown:
            problems.append(f"terms {unknown!r} are not loss terms; use MaskTruncated, TruncatedIS, "
                            "HighEntropyTokens, KLPenalty or EntropyBonus (grpo_engine.losses.terms)")
        if problems:
            raise ValueError("invalid ClippedSurrogate: " + "; ".join(problems))
        terms += list(self.terms)
        object.__setattr__(self, "_filters", tuple(t for t in terms if isinstance(t, _FILTERS)))
        object.__setattr__(self, "_weights", tuple(t for t in terms if isinstance(t, _WEIGHTS)))
        object.__setattr__(self, "_penalties", tuple(t for t in terms if isinstance(t, _PENALTIES)))

    @property
    def requires(self) -> Requirements:
        """What the terms need: reference log-probs (KL), sampler log-probs (TIS), the entropy (bonus,
        high-entropy tokens); rows with advantage 0 matter when a term does not scale with A; the
        high-entropy threshold is taken over every rank's micro-batch (``micro_batch_gather``)."""
        terms = self._filters + self._weights + self._penalties
        return Requirements(ref_logprobs=any(t.requires.ref_logprobs for t in terms),
                            sampler_logprobs=any(t.requires.sampler_logprobs for t in terms),
                            entropy=any(t.requires.entropy for t in terms),
                            zero_advantage_rows=any(t.requires.zero_advantage_rows for t in terms),
                            micro_batch_gather=any(t.requires.micro_batch_gather for t in terms))

    def counts(self, completion_mask: Tensor, is_truncated: Tensor | None = None) -> tuple[int, int]:
        """Step-global ``(num_valid_tokens, num_sequences)``: every valid token and row, less the rows a
        token filter drops (``(0, 0)`` when it drops them all: the step trains nothing).

        Example:
            >>> mask = torch.tensor([[True, True], [True, False]])
            >>> ClippedSurrogate(mask_truncated=True).counts(mask, torch.tensor([True, False]))
            (1, 1)
        """
        keep = None
        for term in self._filters:
            rows = term.keep_rows(is_truncated)
            keep = rows if keep is None else keep & rows
        return common.step_counts(completion_mask, keep)

    def __call__(self, logprobs: Tensor, batch: MicroBatch, *, num_valid_tokens: int,
                 num_sequences: int) -> LossOutput:
        """Loss of one micro-batch, already divided by the step-global count.

        Args:
            logprobs: [n, C] log π_θ of the sampled completion tokens, with gradient.
            batch: the micro-batch (``completion_mask``, ``advantages``; ``old_logprobs`` or None;
                what the terms need: ``ref_logprobs``, ``is_truncated``, ``entropy``,
                ``sampler_logprobs``).
            num_valid_tokens, num_sequences: the step's counts (>= 1), from :meth:`counts`.

        Returns:
            ``LossOutput``: the loss and detached step-share metrics: ``policy_loss``,
            ``clip_fraction`` (valid tokens whose surrogate gradient a clip cuts), and each term's.

        Raises:
            ValueError: counts < 1, mismatched shapes, or an input a term needs is missing.
        """
        self._check(logprobs, batch, num_valid_tokens, num_sequences)
        mask = batch.completion_mask.to(torch.bool)
        for term in self._filters:
            mask = term.filter(mask, batch)
        logp, old, adv = common.policy_inputs(logprobs, batch, mask)
        ratio = common.safe_exp(logp - old)  # the log-ratio clamped at ±20: no inf, no NaN gradient
        clipped_ratio = ratio.clamp(1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high)
        capped_ratio = ratio if self.delta is None else ratio.clamp(max=self.delta)
        unclipped_obj, clipped_obj = capped_ratio * adv, clipped_ratio * adv
        policy = -torch.minimum(unclipped_obj, clipped_obj)  # [n, C]
        clipped = clipped_obj < unclipped_obj
        if self.delta is not None:
            clipped = clipped | ((ratio > self.delta) & (adv != 0))
        metrics: dict[str, Tensor] = {}
        for term in self._weights:
            policy, clipped, extra = term.apply(policy, clipped, logp, old, mask, batch, num_valid_tokens)
            metrics.update(extra)
        token_loss = policy
        for term in self._penalties:
            values, extra = term.tokens(logp, mask, batch, num_valid_tokens)
            token_loss = token_loss + values
            metrics.update(extra)
        counts = dict(num_valid_tokens=num_valid_tokens, num_sequences=num_sequences,
                      max_completion_tokens=self.max_completion_tokens)
        loss = aggregate(token_loss, mask, self.aggregation, **counts)
        metrics["policy_loss"] = aggregate(policy, mask, self.aggregation, **counts).detach()
        metrics["clip_fraction"] = (clipped & mask).sum().to(logp.dtype) / num_valid_tokens
        return LossOutput(loss=loss, metrics=metrics)

    def _check(self, logprobs: Tensor, batch: MicroBatch, num_valid_tokens: int, num_sequences: int) -> None:
        """Raises ValueError naming every bad input of one call."""
        extra = []
        if self.requires.sampler_logprobs and batch.sampler_logprobs is None:
            extra.append(f"tis_cap={self.tis_cap} needs batch.sampler_logprobs [n, C], which is None; use a "
                         "sampler that reports log-probs (HFSampler does) or set tis_cap=None")
        if self._filters and batch.is_truncated is None:
            extra.append("mask_truncated=True needs batch.is_truncated, which is None; "
                         "pass the [n] truncation flags or set mask_truncated=False")
        if self.requires.entropy and batch.entropy is None:
            users = [f"entropy_coef={t.coef}" for t in self._penalties if isinstance(t, EntropyBonus)]
            users += [f"top_entropy_quantile={t.quantile}" for t in self._weights if isinstance(t, HighEntropyTokens)]
            extra.append(f"{' and '.join(users)} needs batch.entropy [n, C], which is missing; compute token "
                         "entropies (completion_logprobs(..., with_entropy=True)) or turn the option off")
        elif self.requires.entropy and tuple(batch.entropy.shape) != tuple(logprobs.shape):
            extra.append(f"entropy shape {tuple(batch.entropy.shape)} must equal logprobs shape "
                         f"{tuple(logprobs.shape)}; pass one entropy per completion token")
        kl = next((t.coef for t in self._penalties if isinstance(t, KLPenalty)), 0.0)
        common.check_call("ClippedSurrogate", logprobs, batch, num_valid_tokens, num_sequences, kl_coef=kl,
                          extra=extra)
