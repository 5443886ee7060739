"""The PPO-style clipped token surrogate of GRPO, DAPO and Dr. GRPO.

Per valid token t of completion i (``logprobs`` with gradient, ``old``/``ref`` without):

    ratio_it = exp(logprobs_it - old_it)
    ℓ_it     = -min(min(ratio_it, δ) · A_i, clip(ratio_it, 1 - clip_eps_low, 1 + clip_eps_high) · A_i)
               + kl_coef · k(logprobs_it, ref_it)
    loss     = agg(ℓ) - entropy_coef · agg(H)

* Clip: two-sided on the token ratio, asymmetric when ``clip_eps_high != clip_eps_low``
  ("Clip-Higher", DAPO, Yu et al. 2025, arXiv 2503.14476, uses 0.2 / 0.28).
* δ (``delta``, off by default): INTELLECT-2's two-sided clip (arXiv 2505.07291) clamps the raw
  ratio of the *unclipped* term above at δ > 1 + clip_eps_high, exactly as TRL's ``delta``
  (the clamp comes after the clipped ratio is formed). It only bites for A < 0, where the loss
  is then capped at -δ·A with no gradient (like dual-clip PPO with c = δ); for A > 0 the ε clip
  already holds the term at 1 + clip_eps_high.
* Old policy: ``batch.old_logprobs``, or the detached current ``logprobs`` when None (one
  update per batch, μ = 1): the ratio is then exactly 1 and ∇ℓ = -A ∇ log π_θ.
* KL: an estimator of KL(π_θ ‖ π_ref) added to the per-token loss (not to the reward), as in
  GRPO (DeepSeekMath, Shao et al. 2024, arXiv 2402.03300), with ``kl_estimator`` "k3" (GRPO's,
  the default), "k2" or "k1" (see :mod:`grpo_engine.losses.kl` for their gradients: k2's is the
  true reverse-KL gradient on-policy, k1's expectation is 0, k3's is biased); off when
  ``kl_coef`` is 0 (the default, as in DAPO and Dr. GRPO). No ratio weighting of the KL term.
* Entropy bonus (off by default): ``entropy_coef`` · the token entropy ``batch.entropy``
  [n, C] (with gradient), aggregated like the loss, is subtracted, so higher entropy lowers
  the loss. TRL instead always uses the token mean of the micro-batch for its bonus.
* Aggregation over the mask m (counts are for the whole optimizer step, so summing the
  micro-batch losses gives the loss of the step):

  - ``"sequence"`` (GRPO): Σ_i [Σ_t ℓ_it m_it / Σ_t m_it] / num_sequences
  - ``"token"`` (DAPO): Σ_it ℓ_it m_it / num_valid_tokens
  - ``"constant"`` (Dr. GRPO, Liu et al. 2025, arXiv 2503.20783, as TRL's ``dr_grpo``):
    Σ_it ℓ_it m_it / (num_sequences · max_completion_tokens)

* High-entropy tokens only (``top_entropy_quantile`` = ρ, off by default; "Beyond the 80/20
  rule", Wang et al. 2025, arXiv 2506.01939, as TRL's ``top_entropy_quantile``): the surrogate
  term ℓ^PG_it is kept only where H_it >= the (1 - ρ) quantile (linear interpolation, as
  ``torch.quantile``) of the valid tokens' entropies, and is 0 elsewhere (see
  :func:`grpo_engine.entropy.token.high_entropy_mask`). The entropies are ``batch.entropy``
  detached: the mask carries no gradient. The aggregation counts are unchanged (a dropped token
  still counts in its denominator, as in TRL). The KL and entropy-bonus terms act on every valid
  token (TRL restricts its entropy bonus to the kept tokens, and takes a plain token mean of
  them). The quantile is over the tokens of the micro-batch, as TRL computes it over each
  optimizer micro-batch (gathered across processes there); it is the step-wide quantile of the
  paper only when the micro-batch is the whole step (``micro_batch_size = completions_per_step``,
  one process), and in general the gradient depends on how the step is cut into micro-batches.
  With ``mask_truncated`` the quantile is over non-truncated rows only (as in TRL).
* Truncated completions: kept by default. With ``mask_truncated=True`` (DAPO's overlong
  filtering) a row with ``batch.is_truncated`` True adds nothing to loss, gradient or metrics,
  and :meth:`ClippedSurrogate.counts` leaves it out of both step counts, so it is filtered out
  rather than counted as a zero. TRL's ``mask_truncated_completions`` zeroes the mask instead:
  its ``grpo`` and ``dr_grpo`` still divide by every row (so they shrink the loss by
  kept/all rows); its token-normalised ``dapo`` agrees with ``"token"`` here.
* Advantages arrive precomputed (see :mod:`grpo_engine.advantages`), one per completion.
* Truncated importance sampling (``tis_cap``, off by default; Yao et al. 2025, "Your efficient RL
  framework secretly brings you off-policy RL training", as TRL's vLLM importance sampling): when
  the sampler's log-probs differ from the trainer's (another engine, another precision), each
  token's surrogate is multiplied by the detached weight min(π_old / π_sampler, tis_cap), with
  π_old the trainer's old policy (the detached current one when μ = 1). The KL and entropy terms
  are not reweighted.

Parity with TRL 1.16 ``GRPOTrainer`` (``tests/test_trl_parity.py``): equal loss and gradient for
``grpo`` = ``"sequence"``, ``dapo`` = ``"token"``, ``dr_grpo`` = ``"constant"``, with
``epsilon_high``, ``delta`` and ``beta`` > 0 (k3, ``use_bias_correction_kl=False``). TRL's
``bnpo`` divides by the micro-batch token count, so it equals ``"token"`` only with a single
micro-batch.

Computation is in float32 (or float64 for float64 inputs). Padded positions are replaced
before any arithmetic, so garbage there (inf, NaN) never reaches the loss or the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from grpo_engine.entropy.token import high_entropy_mask
from grpo_engine.losses import _common as common
from grpo_engine.types import LossOutput, MicroBatch

__all__ = ["ClippedSurrogate"]

Aggregation = Literal["sequence", "token", "constant"]
_AGGREGATIONS = ("sequence", "token", "constant")


@dataclass(frozen=True)
class ClippedSurrogate:
    """Clipped token surrogate with optional KL, δ cap, entropy bonus and overlong filtering.

    Args:
        clip_eps_low: ε_low >= 0; the ratio is clipped below at 1 - ε_low.
        clip_eps_high: ε_high >= 0; clipped above at 1 + ε_high. None means ε_low.
        kl_coef: β >= 0 on the per-token KL to the reference policy; 0 disables it.
        aggregation: ``"sequence"`` (GRPO), ``"token"`` (DAPO) or ``"constant"`` (Dr. GRPO).
        max_completion_tokens: the constant length of ``"constant"`` aggregation (required
            there, ignored otherwise).
        delta: INTELLECT-2's cap δ > 1 + ε_high on the ratio of the unclipped term; None is off.
        kl_estimator: ``"k3"`` (GRPO), ``"k2"`` or ``"k1"``; used when ``kl_coef > 0``.
        mask_truncated: drop completions with ``batch.is_truncated`` (DAPO overlong filtering);
            pass the counts of :meth:`counts` so the step counts leave them out too.
        entropy_coef: coefficient >= 0 of the entropy bonus (needs ``batch.entropy``).
        tis_cap: cap of the truncated importance weight π_old / π_sampler; None is off.
        top_entropy_quantile: ρ in [0, 1]: train the surrogate only on the top-ρ fraction of
            the micro-batch's valid tokens by entropy (the paper uses 0.2; 1 keeps every
            token); None is off. Needs ``batch.entropy``.

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

    def __post_init__(self) -> None:
        if self.clip_eps_high is None:
            object.__setattr__(self, "clip_eps_high", self.clip_eps_low)
        problems = common.nonnegative(clip_eps_low=self.clip_eps_low, clip_eps_high=self.clip_eps_high,
                                 kl_coef=self.kl_coef, entropy_coef=self.entropy_coef)
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
        if self.delta is not None and not self.delta > 1 + self.clip_eps_high:
            problems.append(
                f"delta={self.delta!r} must be > 1 + clip_eps_high = {1 + self.clip_eps_high}; "
                "pass a larger cap (INTELLECT-2 uses 4) or None"
            )
        if self.tis_cap is not None and not self.tis_cap > 0:
            problems.append(f"tis_cap={self.tis_cap!r} must be > 0; use e.g. 2.0, or None to turn it off")
        if self.top_entropy_quantile is not None and not 0.0 <= self.top_entropy_quantile <= 1.0:
            problems.append(f"top_entropy_quantile={self.top_entropy_quantile!r} must be in [0, 1] (the fraction "
                            "of tokens kept); the paper uses 0.2, None turns it off")
        problems.extend(common.check_kl_estimator(self.kl_estimator))
        if problems:
            raise ValueError("invalid ClippedSurrogate: " + "; ".join(problems))

    @property
    def requires_ref_logprobs(self) -> bool:
        """True when ``kl_coef > 0``: the trainer must supply ``batch.ref_logprobs``."""
        return self.kl_coef > 0

    @property
    def requires_sampler_logprobs(self) -> bool:
        """True when ``tis_cap`` is set: the sampler must report its own log-probs."""
        return self.tis_cap is not None

    @property
    def requires_entropy(self) -> bool:
        """True when ``entropy_coef > 0`` or ``top_entropy_quantile`` is set: the trainer must
        supply ``batch.entropy``."""
        return self.entropy_coef > 0 or self.top_entropy_quantile is not None

    @property
    def needs_zero_advantage_rows(self) -> bool:
        """False when ``kl_coef == 0``, ``entropy_coef == 0`` and ``top_entropy_quantile`` is
        None: a completion with advantage 0 then adds exactly 0 to the loss, the gradient and
        every metric, so the trainer may skip its forward and backward.

        With ``top_entropy_quantile`` set it is True even without KL or bonus: a row with
        advantage 0 adds nothing by itself, but its tokens take part in the micro-batch's
        entropy quantile, so leaving it out moves the threshold and changes which tokens of
        the other rows are kept."""
        return self.kl_coef > 0 or self.entropy_coef > 0 or self.top_entropy_quantile is not None

    def counts(self, completion_mask: Tensor, is_truncated: Tensor | None = None) -> tuple[int, int]:
        """Step-global ``(num_valid_tokens, num_sequences)`` to pass to every call of the step.

        Args:
            completion_mask: [N, C] the completion mask of the whole step.
            is_truncated: [N] True where the completion has no EOS (needed with
                ``mask_truncated``).

        Returns:
            Every True mask entry and every row; with ``mask_truncated`` only those of rows
            that are not truncated. ``(0, 0)`` when every row is truncated: the step has
            nothing to train and the trainer skips it (as for any step with 0 valid tokens).

        Example:
            >>> mask = torch.tensor([[True, True], [True, False]])
            >>> ClippedSurrogate(mask_truncated=True).counts(mask, torch.tensor([True, False]))
            (1, 1)
        """
        if not self.mask_truncated:
            return common.step_counts(completion_mask)
        if is_truncated is None:
            raise ValueError("ClippedSurrogate.counts: mask_truncated=True needs is_truncated [N]; "
                             "pass batch.is_truncated")
        return common.step_counts(completion_mask, ~is_truncated.to(torch.bool))

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
                ``old_logprobs`` [n, C] or None, ``ref_logprobs`` [n, C] (when
                ``kl_coef > 0``), ``is_truncated`` [n] (with ``mask_truncated``) and
                ``entropy`` [n, C] (when ``requires_entropy``) are used. ``old``/``ref`` are
                detached; ``entropy`` keeps its gradient.
            num_valid_tokens: valid tokens over the whole step (>= 1), from :meth:`counts`.
            num_sequences: completions in the whole step (>= 1), from :meth:`counts`.

        Returns:
            ``LossOutput`` with the scalar loss and detached metrics, each a step-level share
            (sum over micro-batches): ``policy_loss`` (the surrogate part, same aggregation),
            ``clip_fraction`` (valid tokens whose surrogate gradient a clip cuts: the ε clip
            is the active minimum, or the ratio exceeds δ with A != 0), ``kl`` (token mean of
            the estimator, when ``kl_coef > 0``) and ``entropy`` (token mean, when
            ``entropy_coef > 0``) and ``high_entropy_fraction`` (valid tokens kept by the
            ``top_entropy_quantile`` mask, when set). With ``kl_coef == entropy_coef == 0``
            and no ``top_entropy_quantile``, rows with advantage 0 contribute 0 to every
            metric, so a trainer that skips them (see ``needs_zero_advantage_rows``) still
            reports exact step values. Under the mask, ``clip_fraction`` counts kept tokens only.

        Raises:
            ValueError: for counts < 1, mismatched shapes, or a missing ``ref_logprobs``,
                ``is_truncated`` or ``entropy`` that the settings need.
        """
        entropy = getattr(batch, "entropy", None)
        self._check(logprobs, batch, entropy, num_valid_tokens, num_sequences)
        mask = batch.completion_mask.to(torch.bool)
        if self.mask_truncated:
            mask = mask & ~batch.is_truncated.to(device=mask.device, dtype=torch.bool)[:, None]
        logp, ratio, adv = common.ratio_inputs(logprobs, batch, mask)

        clipped_ratio = ratio.clamp(1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high)
        capped_ratio = ratio if self.delta is None else ratio.clamp(max=self.delta)
        unclipped_obj, clipped_obj = capped_ratio * adv, clipped_ratio * adv
        policy_token = -torch.minimum(unclipped_obj, clipped_obj)  # [n, C]
        metrics: dict[str, Tensor] = {}
        if self.tis_cap is not None:  # truncated importance sampling: pi_old / pi_sampler, capped
            old = logp.detach() if batch.old_logprobs is None else common.masked(batch.old_logprobs, mask, logp.dtype)
            sampler = common.masked(batch.sampler_logprobs.detach(), mask, logp.dtype)
            weight = torch.exp(old - sampler).clamp(max=self.tis_cap)
            policy_token = policy_token * weight
            metrics["tis_weight"] = common.token_share(weight, mask, num_valid_tokens)
        is_clipped = clipped_obj < unclipped_obj
        if self.delta is not None:
            is_clipped = is_clipped | ((ratio > self.delta) & (adv != 0))
        if self.top_entropy_quantile is not None:  # forking tokens only (80/20): no gradient elsewhere
            high = high_entropy_mask(entropy.detach(), mask, self.top_entropy_quantile)
            policy_token = torch.where(high, policy_token, torch.zeros((), dtype=logp.dtype, device=logp.device))
            is_clipped = is_clipped & high
            metrics["high_entropy_fraction"] = high.sum().to(logp.dtype) / num_valid_tokens
        token_loss = policy_token
        if self.kl_coef > 0:
            kl = common.kl_tokens(self.kl_estimator, logp, batch.ref_logprobs, mask)
            token_loss = token_loss + self.kl_coef * kl
            metrics["kl"] = common.token_share(kl, mask, num_valid_tokens).detach()

        loss = self._aggregate(token_loss, mask, num_valid_tokens, num_sequences)
        if self.entropy_coef > 0:
            ent = common.masked(entropy, mask, logp.dtype)
            loss = loss - self.entropy_coef * self._aggregate(ent, mask, num_valid_tokens, num_sequences)
            metrics["entropy"] = common.token_share(ent, mask, num_valid_tokens).detach()
        policy_loss = self._aggregate(policy_token, mask, num_valid_tokens, num_sequences)
        metrics["policy_loss"] = policy_loss.detach()
        metrics["clip_fraction"] = (is_clipped & mask).sum().to(logp.dtype) / num_valid_tokens
        return LossOutput(loss=loss, metrics=metrics)

    def _check(self, logprobs: Tensor, batch: MicroBatch, entropy: Tensor | None,
               num_valid_tokens: int, num_sequences: int) -> None:
        """Raises ValueError naming every bad input of one call."""
        extra = []
        if self.tis_cap is not None and getattr(batch, "sampler_logprobs", None) is None:
            extra.append(f"tis_cap={self.tis_cap} needs batch.sampler_logprobs [n, C], which is None; use a "
                         "sampler that reports log-probs (HFSampler does) or set tis_cap=None")
        if self.mask_truncated and batch.is_truncated is None:
            extra.append("mask_truncated=True needs batch.is_truncated, which is None; "
                         "pass the [n] truncation flags or set mask_truncated=False")
        if self.requires_entropy and entropy is None:
            users = [f"entropy_coef={self.entropy_coef}"] if self.entropy_coef > 0 else []
            if self.top_entropy_quantile is not None:
                users.append(f"top_entropy_quantile={self.top_entropy_quantile}")
            extra.append(f"{' and '.join(users)} needs batch.entropy [n, C], which is missing; compute token "
                         "entropies (completion_logprobs(..., with_entropy=True)) or turn the option off")
        elif self.requires_entropy and tuple(entropy.shape) != tuple(logprobs.shape):
            extra.append(f"entropy shape {tuple(entropy.shape)} must equal logprobs shape "
                         f"{tuple(logprobs.shape)}; pass one entropy per completion token")
        common.check_call("ClippedSurrogate", logprobs, batch, num_valid_tokens, num_sequences,
                     kl_coef=self.kl_coef, extra=extra)

    def _aggregate(
        self, token_loss: Tensor, mask: Tensor, num_valid_tokens: int, num_sequences: int
    ) -> Tensor:
        """Reduces [n, C] per-token values (0 on padding) to the step-share scalar."""
        if self.aggregation == "token":
            return common.token_share(token_loss, mask, num_valid_tokens)
        if self.aggregation == "constant":
            return common.token_share(token_loss, mask, num_sequences * self.max_completion_tokens)
        return common.sequence_share(token_loss, mask, num_sequences)
