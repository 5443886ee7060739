"""The contracts of a GRPO step: every attribute and method the trainer may use of a component.

A variant of any stage is a different object that satisfies one of these protocols; the trainer
never branches on a string and never reads an attribute a protocol does not declare. Math
components (advantages, losses, entropy estimators) are pure functions of tensors: no
``.item()``, no logging, no distributed calls. ``types.py`` has the shape legend (B, G, N, n, C, V).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from grpo_engine.types import LossOutput, MicroBatch, Prompt, Requirements, RewardOutput, RolloutBatch

__all__ = ["Sampler", "SamplerWrapper", "RewardFn", "RewardTransform", "EntropyEstimator", "AdvantageFn",
           "GRPOLoss", "PromptSource"]


@runtime_checkable
class Sampler(Protocol):
    """Draws ``group_size`` completions for each prompt.

    ``temperature``: the sampling temperature; the trainer computes log-probs at it, and a
    controller (``AdaptiveTemperature``) may set it between steps.
    """

    temperature: float

    def sample(self, prompts: Sequence[Prompt], *, group_size: int) -> RolloutBatch:
        """Returns a batch of N = len(prompts) * group_size completions, rows ``b*G ..`` of prompt b."""
        ...


@runtime_checkable
class SamplerWrapper(Protocol):
    """A filter on sampling (DAPO's dynamic sampling) that the trainer binds to its own parts.

    Passed as ``GRPOTrainer(sampler=...)``, it is bound once, at construction, to the sampler the
    trainer would otherwise use, its reward function and its prompt source.
    """

    def bind(self, sampler: Sampler, rewards: Any, prompts: PromptSource) -> Sampler:
        """Returns the Sampler the trainer uses (``rewards`` is the trainer's ``WeightedSum``)."""
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
class RewardTransform(Protocol):
    """Changes a step's rewards once its log-probs are known (e.g. a KL penalty to the reference).

    Listed among the rewards (``GRPOTrainer(rewards=[MathAccuracy(), KLRewardPenalty(0.05)])``);
    the trainer computes what ``requires`` asks for (``old_logprobs``, ``ref_logprobs``) first.
    """

    requires: Requirements

    def transform(self, rewards: RewardOutput, batch: RolloutBatch, *, old_logprobs: Tensor | None,
                  ref_logprobs: Tensor | None) -> RewardOutput:
        """Returns the changed rewards ([B, G] total and breakdown); log-probs are [N, C]."""
        ...


@runtime_checkable
class EntropyEstimator(Protocol):
    """Measures how uncertain the policy is about each prompt.

    ``requires_sampler_logprobs``: the estimator reads ``batch.sampler_logprobs``.
    """

    requires_sampler_logprobs: bool

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

    The trainer reads ``requires`` once, when it is built, and calls ``counts`` once per step, on
    the whole step, to get the ``num_valid_tokens`` and ``num_sequences`` it passes to every
    micro-batch call: accumulating the micro-batch losses then gives exactly the gradient of one
    big batch. A minimal loss::

        class Reinforce:
            requires = Requirements(zero_advantage_rows=False)

            def counts(self, completion_mask, is_truncated):
                return int(completion_mask.sum()), completion_mask.shape[0]

            def __call__(self, logprobs, batch, *, num_valid_tokens, num_sequences):
                mask = batch.completion_mask
                per_token = -batch.advantages[:, None] * logprobs
                return LossOutput(torch.where(mask, per_token, 0.0).sum() / num_valid_tokens)
    """

    requires: Requirements

    def counts(self, completion_mask: Tensor, is_truncated: Tensor) -> tuple[int, int]:
        """Step-global ``(num_valid_tokens, num_sequences)`` from the step's [N, C] mask and [N]
        truncation flags; ``(0, 0)`` means the step has nothing to train."""
        ...

    def __call__(self, logprobs: Tensor, batch: MicroBatch, *, num_valid_tokens: int,
                 num_sequences: int) -> LossOutput:
        """``logprobs`` [n, C] of the current policy, with gradient; the loss is already divided by
        the step-global count, and each metric is a step share (summed over micro-batches)."""
        ...


@runtime_checkable
class PromptSource(Protocol):
    """Where the training prompts come from, one batch per step (``PromptStream``,
    ``InformativeCurriculum``); resumable."""

    def next_batch(self, size: int | None = None) -> list[Prompt]:
        """The next ``size`` prompts (default: the source's batch size)."""
        ...

    def observe(self, batch: RolloutBatch, rewards: RewardOutput, uncertainty: Tensor | None) -> None:
        """Hears how every group drawn did (``uncertainty`` [B] from the entropy estimator, if any)."""
        ...

    def state_dict(self) -> Mapping[str, Any]:
        """The state to checkpoint."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from a saved state."""
        ...
