"""Presets of the GRPO family: plain functions that return the components, never strings.

Each preset returns a :class:`Recipe` (an advantage, a loss composed from the loss terms, an optional
group filter and extra rewards) set as its paper sets them; pass it to the trainer with
``GRPOTrainer(..., rewards=[MathAccuracy(), *recipe.extra_rewards], **recipe.components())``.

- ``grpo()``: group z-score; PPO clip 0.2, per-sequence mean, k3 KL in the loss (beta 0.04).
  DeepSeekMath, arXiv 2402.03300.
- ``dr_grpo(L)``: group mean only; PPO clip 0.2, token sum / (N * L), no KL. arXiv 2503.20783.
- ``dapo(L, Lc)``: group z-score; clip 0.2 / 0.28, token mean, no KL; dynamic sampling and the soft
  overlong penalty. arXiv 2503.14476.
- ``gspo()``: group z-score; sequence-level ratio, clip 3e-4 / 4e-4. arXiv 2507.18071.
- ``cispo()``: group z-score; clipped stop-gradient IS weight, token mean. arXiv 2506.13585.
- ``rloo()``: leave-one-out baseline; PPO clip 0.2, token mean. arXiv 2402.14740.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grpo_engine.advantages import RLOO, GroupNormalized, MeanBaseline
from grpo_engine.losses.cispo import CISPO
from grpo_engine.losses.clipped import ClippedSurrogate
from grpo_engine.losses.gspo import GSPO
from grpo_engine.losses.terms import KLPenalty
from grpo_engine.protocols import AdvantageFn, GroupFilter, GRPOLoss, RewardFn
from grpo_engine.rewards.length import OverlongPenalty
from grpo_engine.sampling.dynamic import DynamicSampling

__all__ = ["Recipe", "grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo"]


@dataclass(frozen=True)
class Recipe:
    """The components of one GRPO-family variant.

    Attributes:
        advantage: the AdvantageFn.
        loss: the GRPOLoss.
        sampler: a group filter on sampling (DAPO's dynamic sampling), or None.
        extra_rewards: rewards the variant adds to the task's own (e.g. DAPO's overlong penalty).
    """

    advantage: AdvantageFn
    loss: GRPOLoss
    sampler: GroupFilter | None = None
    extra_rewards: tuple[RewardFn, ...] = field(default_factory=tuple)

    def components(self) -> dict[str, Any]:
        """Keyword arguments for ``GRPOTrainer``: advantage, loss and (when the recipe has one) sampler."""
        extra = {"sampler": self.sampler} if self.sampler is not None else {}
        return {"advantage": self.advantage, "loss": self.loss, **extra}


def grpo(kl_coef: float = 0.04, clip_eps: float = 0.2) -> Recipe:
    """GRPO as in DeepSeekMath: z-scored group advantages, per-sequence mean, k3 KL in the loss."""
    return Recipe(GroupNormalized(),
                  ClippedSurrogate(clip_eps_low=clip_eps, aggregation="sequence",
                                   terms=(KLPenalty(kl_coef, "k3"),) if kl_coef > 0 else ()))


def dr_grpo(max_completion_tokens: int, clip_eps: float = 0.2) -> Recipe:
    """Dr. GRPO: no std and no length normalisation (token sum over a constant), no KL."""
    return Recipe(MeanBaseline(), ClippedSurrogate(clip_eps_low=clip_eps, aggregation="constant",
                                                   max_completion_tokens=max_completion_tokens))


def dapo(max_completion_tokens: int, cache_tokens: int, max_sampling_rounds: int = 3,
         accuracy_key: str | None = "math_accuracy") -> Recipe:
    """DAPO: clip-higher, token-level loss, dynamic sampling and soft overlong punishment, no KL.

    Args:
        max_completion_tokens: the generation limit L_max (the config's ``max_completion_tokens``).
        cache_tokens: L_c, the soft-punishment band before L_max.
        max_sampling_rounds: bound on dynamic-sampling rounds per step.
        accuracy_key: the reward whose groups must not tie (DAPO filters on accuracy, not on the
            total that includes the overlong penalty); None filters on the total.
    """
    return Recipe(
        GroupNormalized(),
        ClippedSurrogate(clip_eps_low=0.2, clip_eps_high=0.28, aggregation="token"),
        sampler=DynamicSampling(max_rounds=max_sampling_rounds, key=accuracy_key),
        extra_rewards=(OverlongPenalty(max_completion_tokens, cache_tokens),),
    )


def gspo(clip_eps_low: float = 3e-4, clip_eps_high: float = 4e-4) -> Recipe:
    """GSPO: the sequence-level geometric-mean ratio with its small clip range, no KL."""
    return Recipe(GroupNormalized(), GSPO(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high))


def cispo(clip_eps_high: float = 4.0) -> Recipe:
    """CISPO: every token keeps its gradient, weighted by a clipped stop-gradient IS ratio."""
    return Recipe(GroupNormalized(), CISPO(clip_eps_high=clip_eps_high))


def rloo(clip_eps: float = 0.2) -> Recipe:
    """RLOO: the leave-one-out baseline with the PPO surrogate, token mean, no KL."""
    return Recipe(RLOO(), ClippedSurrogate(clip_eps_low=clip_eps, aggregation="token"))
