"""The PPO-style clipped token surrogate of GRPO, DAPO and Dr. GRPO, with composable terms.

Per valid token t of completion i, with ratio_it = exp(clamp(logprobs_it - old_it, ±20)) (old: the
detached current log-probs when ``batch.old_logprobs`` is None, so the ratio is exactly 1 on-policy):

    policy_it = -min(min(ratio_it, δ) · A_i, clip(ratio_it, 1 - ε_low, 1 + ε_high) · A_i)
    loss      = aggregate(policy · weights + penalties)           (losses/aggregation.py)

The clip is asymmetric when ε_high != ε_low ("Clip-Higher", DAPO, arXiv 2503.14476); δ (off by
default) caps the unclipped ratio (INTELLECT-2, arXiv 2505.07291). The terms (losses/terms.py): row
filters (``mask_truncated``), then loss terms in order: surrogate weights (``tis_cap``,
``top_entropy_quantile``) and per-token penalties (``kl_coef``: k3 KL to the reference as in GRPO,
arXiv 2402.03300; ``entropy_coef``: entropy bonus), from keyword arguments or ``terms``, a user's
``LossTerm`` / ``RowFilter`` included. Computation is in
float32 (float64 for float64 inputs); padded positions never reach arithmetic. docs/algorithms.md
compares it with TRL and verl.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch
from torch import Tensor

from grpo_engine.losses import _common as common
from grpo_engine.losses.aggregation import AGGREGATIONS, Aggregation, aggregate
from grpo_engine.losses.covariance import ClipCov, KLCov
from grpo_engine.losses.terms import (
    TIS_MODES,
    EntropyBonus,
    HighEntropyTokens,
    KLPenalty,
    MaskTruncated,
    OffPolicySequenceMask,
    RatioWeightedKL,
    TruncatedIS,
)
from grpo_engine.ops.tokens import pooled_values
from grpo_engine.protocols import LossTerm, RowFilter
from grpo_engine.types import LossOutput, MicroBatch, Requirements, TokenLoss

__all__ = ["ClippedSurrogate"]


# fields newer than 0.1, and their defaults
_ADDED_DEFAULTS = {"tis_mode": "token_truncate", "off_policy_mask_threshold": None,
                   "kl_ratio_weighted": False, "tis_cap_min": None, "clip_cov_ratio": None,
                   "kl_cov_ratio": None, "kl_cov_coef": 1.0}


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
        tis_mode: ``"token_truncate"`` (default), ``"token_mask"``, ``"sequence_truncate"`` or
            ``"sequence_mask"`` (TRL's names; see :class:`TruncatedIS`).
        top_entropy_quantile: ρ in [0, 1]: the policy term on the top-ρ entropy tokens only
            (a :class:`HighEntropyTokens` term); None is off.
        off_policy_mask_threshold: δ >= 0: drop the policy term of completions with A < 0 whose mean
            log-ratio to the sampling policy exceeds δ (an :class:`OffPolicySequenceMask`, DeepSeek-V3.2;
            TRL's ``off_policy_mask_threshold``); None is off.
        tis_cap_min: the lower bound C_min of the importance weight, in every ``tis_mode`` (truncated at it,
            or masked below it; TRL's ``vllm_importance_sampling_clip_min``); alone (``tis_cap=None``) a
            lower bound only. IcePop: ``tis_cap=5, tis_mode="token_mask", tis_cap_min=0.5``.
        clip_cov_ratio: r in (0, 1]: Clip-Cov (arXiv 2505.22617), a random r-share of the unclipped tokens
            with covariance in (1, 5) lose their policy term (a :class:`~grpo_engine.losses.ClipCov`);
            the paper's 2e-4. None is off.
        kl_cov_ratio: k in (0, 1]: KL-Cov, the top-k share of tokens by covariance get
            ``kl_cov_coef`` · |log π_θ - log π_old| (a :class:`~grpo_engine.losses.KLCov`); None is off.
        kl_cov_coef: β > 0 of KL-Cov (paper: 1.0).
        kl_ratio_weighted: the KL times the ratio π_θ/π_old (a :class:`RatioWeightedKL` in place of the
            :class:`KLPenalty`; TRL's ``use_bias_correction_kl``); needs ``kl_coef > 0``.
        terms: further ``RowFilter`` and ``LossTerm`` objects (``grpo_engine.protocols``), yours
            included, composed after those the keyword arguments make.

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
    tis_mode: str = "token_truncate"
    top_entropy_quantile: float | None = None
    terms: tuple[Any, ...] = field(default_factory=tuple)
    off_policy_mask_threshold: float | None = None
    kl_ratio_weighted: bool = False
    tis_cap_min: float | None = None
    clip_cov_ratio: float | None = None
    kl_cov_ratio: float | None = None
    kl_cov_coef: float = 1.0

    def __post_init__(self) -> None:
        if self.clip_eps_high is None:
            object.__setattr__(self, "clip_eps_high", self.clip_eps_low)
        problems = common.nonnegative(clip_eps_low=self.clip_eps_low, clip_eps_high=self.clip_eps_high,
                                      kl_coef=self.kl_coef, entropy_coef=self.entropy_coef)
        if self.aggregation not in AGGREGATIONS:
            problems.append(f"aggregation={self.aggregation!r} is not one of {AGGREGATIONS}; "
                            "pick one of them")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            problems.append(f"max_completion_tokens={self.max_completion_tokens!r} must be >= 1; pass the "
                            "generation limit")
        if self.aggregation == "constant" and self.max_completion_tokens is None:
            problems.append("aggregation='constant' divides by max_completion_tokens, which is None; pass "
                            "max_completion_tokens (the generation limit)")
        if self.delta is not None and not self.delta > 1 + self.clip_eps_high:
            problems.append(f"delta={self.delta!r} must be > 1 + clip_eps_high = {1 + self.clip_eps_high}; "
                            "pass a larger cap (INTELLECT-2 uses 4) or None")
        problems.extend(common.check_kl_estimator(self.kl_estimator))
        if self.kl_ratio_weighted and not self.kl_coef > 0:
            problems.append("kl_ratio_weighted=True weights the KL, but kl_coef=0 turns it off; "
                            "pass kl_coef > 0")
        if self.tis_mode not in TIS_MODES:
            problems.append(f"tis_mode={self.tis_mode!r} is not one of {TIS_MODES}; use 'token_truncate'")
        made: list[Any] = []
        try:
            made += [MaskTruncated()] if self.mask_truncated else []
            made += ([TruncatedIS(self.tis_cap, self.tis_mode, self.tis_cap_min)]
                     if self.tis_cap is not None or self.tis_cap_min is not None else [])
            made += ([HighEntropyTokens(self.top_entropy_quantile)]
                     if self.top_entropy_quantile is not None else [])
            made += ([OffPolicySequenceMask(self.off_policy_mask_threshold)]
                     if self.off_policy_mask_threshold is not None else [])
            made += [ClipCov(self.clip_cov_ratio)] if self.clip_cov_ratio is not None else []
            made += [KLCov(self.kl_cov_ratio, self.kl_cov_coef)] if self.kl_cov_ratio is not None else []
            kl_term = RatioWeightedKL if self.kl_ratio_weighted else KLPenalty
            made += [kl_term(self.kl_coef, self.kl_estimator)] if self.kl_coef > 0 and not problems else []
            made += [EntropyBonus(self.entropy_coef)] if self.entropy_coef > 0 else []
        except ValueError as error:
            problems.append(str(error))
        unknown = [t for t in self.terms if not isinstance(t, (RowFilter, LossTerm))]
        if unknown:
            problems.append(f"terms {unknown!r} are neither a RowFilter (keep_rows) nor a LossTerm (called "
                            "on a TokenLoss), each with `requires` (grpo_engine.protocols)")
        if problems:
            raise ValueError("invalid ClippedSurrogate: " + "; ".join(problems))
        made += list(self.terms)
        object.__setattr__(self, "_filters", tuple(t for t in made if isinstance(t, RowFilter)))
        object.__setattr__(self, "_terms", tuple(t for t in made if not isinstance(t, RowFilter)))

    def __repr__(self) -> str:
        """The dataclass repr, without the fields added after 0.1 while at their default (so a checkpoint
        saved before them still describes the same loss)."""
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr
                 and not (f.name in _ADDED_DEFAULTS and getattr(self, f.name) == _ADDED_DEFAULTS[f.name])]
        return f"{type(self).__name__}({', '.join(shown)})"

    @property
    def requires(self) -> Requirements:
        """What the filters and terms need: reference log-probs (KL), sampler log-probs (TIS), the
        entropy (bonus, high-entropy tokens) and its pool over every rank (high-entropy tokens); rows
        with advantage 0 matter when a term does not scale with A."""
        return Requirements.union([t.requires for t in self._filters + self._terms])

    def counts(self, completion_mask: Tensor, is_truncated: Tensor | None = None) -> tuple[int, int]:
        """Step-global ``(num_valid_tokens, num_sequences)``: every valid token and row, less the rows a
        row filter drops (``(0, 0)`` when it drops them all: the step trains nothing).

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

    def pooled_entropy(self, batch: MicroBatch) -> Tensor:
        """[n * C] the detached entropies of the tokens that count (after the row filters), +inf elsewhere:
        this micro-batch's share of ``MicroBatch.entropy_pool`` (``PooledEntropyLoss``), of a size the
        host knows without reading the device (``ops.tokens.pooled_values``)."""
        return pooled_values(batch.entropy, self._mask(batch))

    def __call__(self, logprobs: Tensor, batch: MicroBatch, *, num_valid_tokens: int,
                 num_sequences: int) -> LossOutput:
        """Loss of one micro-batch, already divided by the step-global count.

        Args:
            logprobs: [n, C] log π_θ of the sampled completion tokens, with gradient.
            batch: the micro-batch (``completion_mask``, ``advantages``; ``old_logprobs`` or None;
                what the terms need: ``ref_logprobs``, ``is_truncated``, ``entropy``,
                ``sampler_logprobs``, ``entropy_pool``).
            num_valid_tokens, num_sequences: the step's counts (>= 1), from :meth:`counts`.

        Returns:
            ``LossOutput``: the loss and detached step-share metrics: ``policy_loss``,
            ``clip_fraction`` (valid tokens whose surrogate gradient a clip cuts), and each term's.

        Raises:
            ValueError: counts < 1, mismatched shapes, or an input a term needs is missing.
        """
        self._check(logprobs, batch, num_valid_tokens, num_sequences)
        mask = self._mask(batch)
        logp, old, adv = common.policy_inputs(logprobs, batch, mask)
        ratio = common.safe_exp(logp - old)  # the log-ratio clamped at ±20: no inf, no NaN gradient
        clipped_ratio = ratio.clamp(1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high)
        capped_ratio = ratio if self.delta is None else ratio.clamp(max=self.delta)
        unclipped_obj, clipped_obj = capped_ratio * adv, clipped_ratio * adv
        clipped = clipped_obj < unclipped_obj
        if self.delta is not None:
            clipped = clipped | ((ratio > self.delta) & (adv != 0))
        tokens = TokenLoss(mask=mask, logprobs=logp, old_logprobs=old, clipped=clipped,
                           policy=-torch.minimum(unclipped_obj, clipped_obj), penalty=torch.zeros_like(logp),
                           num_valid_tokens=num_valid_tokens)
        for term in self._terms:
            tokens = term(tokens, batch)
        counts = dict(num_valid_tokens=num_valid_tokens, num_sequences=num_sequences,
                      max_completion_tokens=self.max_completion_tokens)
        loss = aggregate(tokens.policy + tokens.penalty, mask, self.aggregation, **counts)
        metrics = dict(tokens.metrics)
        metrics["policy_loss"] = aggregate(tokens.policy, mask, self.aggregation, **counts).detach()
        metrics["clip_fraction"] = (tokens.clipped & mask).sum().to(logp.dtype) / num_valid_tokens
        return LossOutput(loss=loss, metrics=metrics)

    def _mask(self, batch: MicroBatch) -> Tensor:
        """[n, C] the tokens that count: the completion mask less the rows a filter drops."""
        mask = batch.completion_mask.to(torch.bool)
        for term in self._filters:
            mask = mask & term.keep_rows(batch.is_truncated).to(mask.device)[:, None]
        return mask

    def _check(self, logprobs: Tensor, batch: MicroBatch, num_valid_tokens: int, num_sequences: int) -> None:
        """Raises ValueError naming every bad input of one call: the loss's own, and what each term
        declares it needs (``Requirements.missing``)."""
        shape, needs = tuple(logprobs.shape), {}
        for term in self._terms:
            for problem in term.requires.missing(batch, shape):
                needs.setdefault(problem, []).append(str(term))
        extra = [f"{' and '.join(terms)} {problem}" for problem, terms in needs.items()]
        common.check_call("ClippedSurrogate", logprobs, batch, num_valid_tokens, num_sequences, kl_coef=0.0,
                          extra=extra)
