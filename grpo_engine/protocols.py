"""The five component contracts of a GRPO step.

A variant of any stage is a different object that satisfies one of these protocols; the trainer
never branches on a string. Math components (advantages, losses, entropy estimators) are pure
functions of tensors: no ``.item()``, no logging, no distributed calls. See ``types.py`` for the
shape legend (B, G, N, n, C, T, V).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from torch import Tensor

from grpo_engine.types import LossOutput, MicroBatch, Prompt, RewardOutput, RolloutBatch

__all__ = ["Sampler", "RewardFn", "EntropyEstimator", "AdvantageFn", "GRPOLoss"]


@runtime_checkable
class Sampler(Protocol):
    """Draws ``group_size`` completions for each prompt."""

    def sample(self, prompts: Sequence[Prompt], *, group_size: int) -> RolloutBatch:
        """Returns a batch of N = len(prompts) * group_size completions."""
        ...


@runtime_checkable
class RewardFn(Protocol):
    """Scores completions; ``prompts[i]`` is the prompt of ``completions[i]``."""

    name: str
    weight: float

    def __call__(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> Tensor:
        """Returns [N] float scores."""
        ...


@runtime_checkable
class EntropyEstimator(Protocol):
    """Measures how uncertain the policy is about each prompt."""

    def __call__(self, batch: RolloutBatch, rewards: RewardOutput) -> Tensor:
        """Returns [B] per-group uncertainty."""
        ...


@runtime_checkable
class AdvantageFn(Protocol):
    """Turns group rewards into per-completion advantages."""

    def __call__(self, rewards: Tensor, *, uncertainty: Tensor | None = None) -> Tensor:
        """Maps rewards [B, G] (and optional uncertainty [B]) to advantages [B, G]."""
        ...


@runtime_checkable
class GRPOLoss(Protocol):
    """The policy objective for one micro-batch.

    ``num_valid_tokens`` and ``num_sequences`` are counts over the whole optimizer step (all
    micro-batches, all processes), so accumulating the micro-batch losses gives exactly the
    gradient of one big batch.

    ``requires_ref_logprobs`` tells the trainer whether to compute reference log-probs (and so
    whether it needs a reference policy at all).
    """

    requires_ref_logprobs: bool

    def __call__(
        self,
        logprobs: Tensor,
        batch: MicroBatch,
        *,
        num_valid_tokens: int,
        num_sequences: int,
    ) -> LossOutput:
        """``logprobs`` [n, C] of the current policy, with gradient."""
        ...
