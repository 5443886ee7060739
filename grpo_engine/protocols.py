"""The contracts of a GRPO step: every method and attribute the trainer uses of a component.

A variant of any stage is a different object that satisfies one of these protocols; the trainer
never branches on a string and never reads an attribute a protocol does not declare. Math
components (advantages, losses, loss terms, entropy estimators) are pure functions of tensors: no
``.item()``, no logging, no distributed calls; a statistic over every rank (the top-entropy
threshold's pool, dynamic sampling's count of kept groups) is computed by the trainer and handed
in. ``types.py`` has the records and the shape legend (B, G, N, n, C, V).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from grpo_engine.types import (
    Draws,
    LossOutput,
    MicroBatch,
    Prompt,
    Requirements,
    RewardOutput,
    RolloutBatch,
    TokenLoss,
)

__all__ = ["Sampler", "GroupFilter", "RewardFn", "RewardTransform", "EntropyEstimator", "AdvantageFn",
           "GRPOLoss", "PooledEntropyLoss", "LossTerm", "RowFilter", "PromptSource"]


@runtime_checkable
class Sampler(Protocol):
    """Draws ``group_size`` completions for each prompt.

    The trainer calls ``prompt_tokens`` on every training prompt when it is built (to find prompts
    longer than ``max_prompt_tokens``) and ``sample`` once per step (once per round under a group
    filter), with the temperature in force and the call's ``Draws``. Under ``torchrun`` each rank
    samples its share of the step's prompts, and ``draws`` says where that share sits among every
    rank's: a sampler that keys each row's token draws by ``draws.seed`` and the row's place
    (``HFSampler`` does) makes K ranks draw the completions one process draws. The attributes
    ``max_prompt_tokens``, ``max_completion_tokens``, ``temperature``, ``top_p`` and ``top_k``, where a
    sampler has them, are agreed with the run's ``GRPOConfig`` when the trainer is built
    (:mod:`grpo_engine.sampling.settings`).
    """

    def prompt_tokens(self, prompt: Prompt) -> list[int]:
        """The token ids of the rendered prompt, whole (before any truncation)."""
        ...

    def sample(self, prompts: Sequence[Prompt], *, group_size: int, temperature: float,
               draws: Draws) -> RolloutBatch:
        """Returns a batch of N = len(prompts) * group_size completions, rows ``b*G ..`` of prompt b,
        sampled at ``temperature`` (the trainer computes its log-probs at it too)."""
        ...


@runtime_checkable
class GroupFilter(Protocol):
    """Which sampled groups to train on (DAPO's dynamic sampling): the trainer samples, scores and
    asks ``keep``; it draws fresh prompts for the groups still missing, for at most ``max_rounds``
    rounds, and trains on the first ``prompts_per_step`` groups kept (all of the last round when
    none was). Passed as ``GRPOTrainer(sampler=...)``.
    """

    max_rounds: int

    def keep(self, rewards: RewardOutput) -> Tensor:
        """[B] bool: the groups of a round, scored ([B, G]), that carry a learning signal."""
        ...


@runtime_checkable
class RewardFn(Protocol):
    """Scores completions; ``prompts[i]`` is the prompt of ``completions[i]``.

    Three optional members, read where present: ``score_rollout(batch) -> [N]`` scores a
    ``RolloutBatch`` instead of the call (rewards on tokens, ``OverlongPenalty``); ``check(prompt) ->
    str | None`` says why a training prompt cannot be scored (``Reward.check``; the trainer asks when
    it is built); ``allows_none = True`` lets a score be NaN, "does not apply" (``FunctionReward``).
    """

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

    ``requires``: read once; ``sampler_logprobs=True`` makes the default sampler report the sampled
    tokens' log-probs (``batch.sampler_logprobs``), which the estimator then reads.
    """

    requires: Requirements

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
class PooledEntropyLoss(GRPOLoss, Protocol):
    """A loss that takes a statistic over the i-th micro-batch of every rank (``requires.entropy_pool``).

    Per micro-batch the trainer calls ``pooled_entropy`` (pure: this micro-batch's contribution),
    concatenates the results of every rank, and passes them as ``MicroBatch.entropy_pool`` to the
    loss call. On one process the pool is this micro-batch's own values.
    """

    def pooled_entropy(self, batch: MicroBatch) -> Tensor:
        """[k] this micro-batch's share of the pool (e.g. the entropies of the tokens that count)."""
        ...


@runtime_checkable
class LossTerm(Protocol):
    """One change to ``ClippedSurrogate``'s per-token loss: a surrogate weight (rescale or mask
    ``policy``, narrow ``clipped``) or a penalty (add to ``penalty``), with metrics.

    Terms run in the order given, after the clip, on a :class:`~grpo_engine.types.TokenLoss`; each
    returns a new one (``tokens.replace(...)``). ``requires`` says what the micro-batch must carry;
    ``zero_advantage_rows=True`` when the term changes the loss of rows with advantage 0. A term
    that adds a per-token penalty β · (logp - ref)²::

        class SquaredDistance:
            requires = Requirements(ref_logprobs=True)

            def __call__(self, tokens, batch):
                diff = tokens.logprobs - batch.ref_logprobs
                penalty = torch.where(tokens.mask, 0.1 * diff ** 2, 0.0)
                return tokens.replace(penalty=tokens.penalty + penalty)
    """

    requires: Requirements

    def __call__(self, tokens: TokenLoss, batch: MicroBatch) -> TokenLoss:
        """The per-token loss after this term."""
        ...


@runtime_checkable
class RowFilter(Protocol):
    """Which completions count in ``ClippedSurrogate`` at all (DAPO's overlong filtering): a row it
    drops adds nothing to the loss, the gradient or the metrics, and leaves both step counts."""

    requires: Requirements

    def keep_rows(self, is_truncated: Tensor) -> Tensor:
        """[N] bool from the [N] truncation flags: True for the rows that count."""
        ...


@runtime_checkable
class PromptSource(Protocol):
    """Where the training prompts come from, one batch per step (``PromptStream``,
    ``InformativeCurriculum``); resumable.

    ``prompts``: every prompt it may serve (the trainer checks them all when it is built).
    """

    prompts: Sequence[Prompt]

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
