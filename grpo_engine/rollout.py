"""Stages 1 and 2 of a step: sample a group of completions for each prompt, score them, and estimate
each group's uncertainty; then hand every rank the whole step.

Each rank samples its share of the step's prompts (:meth:`World.share`; all of them on one process)
with ``Draws`` that key each row's token draws by its place in the whole step, scores it and runs
the entropy estimator; the parallelism strategy gathers the whole step (a
:class:`~grpo_engine.types.StepRollout`). With a group filter (DAPO's dynamic sampling,
:class:`~grpo_engine.protocols.GroupFilter`) this repeats in rounds: the kept groups of every rank
are counted together, the first ``prompts_per_step`` of them (in the order one process draws them)
are marked for training, and fresh prompts for the groups still missing come from the prompt source,
the same on every rank, each rank sampling its share; at most ``max_rounds`` rounds. When no group
was kept, the last round is trained on as it is (every advantage 0). Every group drawn stays in the
rollout, marked or not, so callbacks and the prompt source hear about all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from types import MappingProxyType

import torch

from grpo_engine.distributed import DataParallel
from grpo_engine.logging import StageTimer
from grpo_engine.protocols import EntropyEstimator, GroupFilter, PromptSource, Sampler
from grpo_engine.types import Draws, Prompt, RewardOutput, Rollout, RolloutBatch, StepRollout

__all__ = ["Rollouts"]


class Rollouts:
    """Draws a step's rollout: sampling, scoring, uncertainty, and a group filter's rounds.

    Args:
        sampler: draws the completions.
        score: a batch's rewards (the trainer's reward combination and runner).
        entropy: the per-group uncertainty, or None.
        parallel: the parallelism strategy (which prompts this rank samples; the whole step).
        group_size: G.
        group_filter: keeps the groups with a learning signal (``DynamicSampling``), or None.
        refill: the prompt source the filter's extra rounds draw from.

    Example:
        >>> # rollouts = Rollouts(sampler, score, None, DataParallel(World()), group_size=8)
        >>> # step = rollouts.collect(prompts, temperature=1.0, timer=StageTimer())
    """

    def __init__(self, sampler: Sampler, score: Callable[[RolloutBatch], RewardOutput],
                 entropy: EntropyEstimator | None, parallel: DataParallel, *, group_size: int,
                 group_filter: GroupFilter | None = None, refill: PromptSource | None = None) -> None:
        if group_filter is not None and refill is None:
            raise ValueError("a group filter needs a prompt source to draw its fresh prompts from (refill=)")
        self.sampler, self.score, self.entropy, self.parallel = sampler, score, entropy, parallel
        self.group_size, self.group_filter, self.refill = group_size, group_filter, refill

    def collect(self, prompts: Sequence[Prompt], *, temperature: float, timer: StageTimer) -> StepRollout:
        """The step's rollout for ``prompts`` (the whole step's, the same on every rank), sampled at
        ``temperature``; ``timer`` gets the ``sample`` and ``reward`` stages."""
        if self.group_filter is None:
            return self.parallel.gather_step(self._round(prompts, temperature, timer))
        return self._filtered(prompts, temperature, timer)

    def _round(self, prompts: Sequence[Prompt], temperature: float, timer: StageTimer) -> Rollout | None:
        """This rank's share of ``prompts`` sampled, scored and estimated (None: no share this time)."""
        mine, first = self.parallel.world.share(prompts)
        draws = Draws.seeded(first, len(prompts))  # taken on every rank, a share or not: they stay in step
        if not mine:
            return None
        with timer("sample"), self.parallel.whole_weights():
            batch = self.sampler.sample(mine, group_size=self.group_size, temperature=temperature,
                                        draws=draws)
        with timer("reward"):
            rewards = self.score(batch)
            uncertainty = self.entropy(batch, rewards) if self.entropy is not None else None
        return Rollout(batch, rewards, uncertainty)

    def _filtered(self, prompts: Sequence[Prompt], temperature: float, timer: StageTimer) -> StepRollout:
        """Rounds of sampling until ``len(prompts)`` groups with a signal are kept (see the module
        docstring)."""
        need, kept, rounds, parts, todo = len(prompts), 0, 0, [], list(prompts)
        while True:
            part = self._round(todo, temperature, timer)
            signal = (self.group_filter.keep(part.rewards) if part is not None
                      else torch.zeros(0, dtype=torch.bool))
            shares = self.parallel.world.gather_objects(signal.tolist())  # the round's groups, in rank order
            every = torch.tensor([flag for share in shares for flag in share], dtype=torch.bool)
            take = every & (every.long().cumsum(0) <= need - kept)  # the first ones still missing
            kept, rounds = kept + int(take.sum()), rounds + 1
            if part is not None:
                first = sum(len(share) for share in shares[:self.parallel.world.rank])
                parts.append(_marked(part, take[first:first + len(signal)]))
            if kept >= need or rounds >= self.group_filter.max_rounds:
                break
            todo = self.refill.next_batch(need - kept)  # the same on every rank; each samples its share
        if kept == 0:  # nothing to learn from: the last round as it is (every rank had a share of all B)
            parts[-1] = _marked(parts[-1], torch.ones(parts[-1].batch.num_prompts, dtype=torch.bool))
        step = self.parallel.gather_step(Rollout.concat(parts))
        drawn = step.whole.rewards.total.double()
        return _with_metrics(step, {"dynamic_sampling/rounds": float(rounds),
                                    "dynamic_sampling/groups_sampled": float(step.whole.batch.num_prompts),
                                    "dynamic_sampling/groups_kept": float(kept),
                                    "reward/mean_sampled": float(drawn.sum()) / max(drawn.numel(), 1)})


def _marked(rollout: Rollout, trained_groups: torch.Tensor) -> Rollout:
    batch = dataclasses.replace(rollout.batch, trained_groups=trained_groups.to(rollout.rewards.total.device))
    return dataclasses.replace(rollout, batch=batch)


def _with_metrics(step: StepRollout, metrics: dict[str, float]) -> StepRollout:
    """``step`` with ``metrics`` added to the whole step's batch metrics (what the step logs)."""
    batch = step.whole.batch
    whole = dataclasses.replace(step.whole, batch=dataclasses.replace(
        batch, metrics=MappingProxyType({**batch.metrics, **metrics})))
    return dataclasses.replace(step, whole=whole)
