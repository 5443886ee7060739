"""DAPO dynamic sampling: train only on groups that carry a learning signal; a Sampler wrapper.

DAPO (arXiv 2503.14476, section 3.2) drops every group whose rewards are all equal (every advantage
0: no gradient, a diluted step) and samples fresh prompts until the batch is full. ``GRPOTrainer(
sampler=DynamicSampling(...))`` binds it to the trainer's sampler, rewards and prompt source:

- A group is kept iff its rewards are not all equal: the total, or one reward of the breakdown
  with ``key`` (``key="math_accuracy"`` keeps exactly DAPO's 0 < accuracy < 1).
- Round 1 samples the prompts it is given; each further round draws as many fresh prompts as groups
  are still missing, up to ``max_rounds`` rounds.
- It returns every group drawn, scored, with the first B kept groups marked in ``trained_groups``
  (none kept: the last round's, every advantage 0); ``metrics``: rounds, groups sampled and kept.
- Under data parallel (bound with a ``World``) the rounds are the whole step's: every rank draws the
  same fresh prompts and samples its slice, and the groups kept are those one process keeps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import Tensor

from grpo_engine.protocols import PromptSource, Sampler
from grpo_engine.types import Prompt, RewardOutput, RolloutBatch

__all__ = ["DynamicSampling", "concat_rollouts", "concat_rewards", "select_groups"]


@dataclass(frozen=True)
class DynamicSampling:
    """Keeps sampling until ``B`` groups with unequal rewards are found (DAPO); a ``SamplerWrapper``.

    Args:
        max_rounds: sampling rounds per step at most (>= 1; 1 only filters).
        key: the breakdown reward to filter on (e.g. "math_accuracy"); None filters on the total.
        sampler, rewards, prompts: what it draws from, scores with and refills from; set by
            :meth:`bind` (the trainer binds it to its own).

    Example:
        >>> # trainer = GRPOTrainer(model, rewards, prompts, sampler=DynamicSampling(max_rounds=3))
    """

    max_rounds: int = 3
    key: str | None = None
    sampler: Sampler | None = None
    rewards: Any = None
    prompts: PromptSource | None = None
    world: Any = None  # a grpo_engine.distributed.World under torchrun (None: one process)
    data_parallel: ClassVar[bool] = True  # the trainer may bind it with a World

    def __post_init__(self) -> None:
        if self.max_rounds < 1:
            raise ValueError(f"max_rounds={self.max_rounds} must be >= 1; use e.g. 3")

    @property
    def temperature(self) -> float:
        """The wrapped sampler's temperature (set through to it)."""
        return self.sampler.temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        self.sampler.temperature = value

    def bind(self, sampler: Sampler, rewards: Any, prompts: PromptSource, world: Any = None) -> DynamicSampling:
        """A copy that draws from ``sampler``, scores with ``rewards`` and refills from ``prompts`` (the
        same on every rank of ``world``)."""
        return dataclasses.replace(self, sampler=sampler, rewards=rewards, prompts=prompts, world=world)

    def sample(self, prompts: Sequence[Prompt], *, group_size: int) -> RolloutBatch:
        """Every group drawn this step, scored, the ones to train on marked (see the module docstring)."""
        if self.sampler is None or self.rewards is None or self.prompts is None:
            raise ValueError("DynamicSampling is not bound to a sampler, rewards and a prompt source; pass it as "
                             "GRPOTrainer(sampler=DynamicSampling(...)) or call bind(sampler, rewards, prompts)")
        rank, ranks = (self.world.rank, self.world.size) if self.world is not None else (0, 1)
        need, kept, rounds = len(prompts) * ranks, 0, 0  # need: the whole step's groups
        batches: list[RolloutBatch] = []
        todo, place = list(prompts), (rank * len(prompts), need)
        sampled = [0.0, 0.0]  # sum and count of the rewards drawn (this rank's)
        while True:
            informative = torch.zeros(0, dtype=torch.bool)
            if todo:
                if ranks > 1:
                    self.sampler.place = place
                batch = self.sampler.sample(todo, group_size=group_size)
                rewards = self.rewards(batch)
                if self.key is not None and self.key not in rewards.breakdown:
                    raise KeyError(f"DynamicSampling(key={self.key!r}) but the rewards are "
                                   f"{sorted(rewards.breakdown)}; use one of those names or key=None")
                signal = rewards.total if self.key is None else rewards.scored(self.key,
                                                                                f"DynamicSampling(key={self.key!r})")
                informative = (signal != signal[:, :1]).any(dim=1).cpu()
                sampled = [sampled[0] + float(rewards.total.float().sum()), sampled[1] + rewards.total.numel()]
            else:  # no prompt for this rank this round: take the seed a call takes, as the others do
                getattr(self.sampler, "call_seed", lambda: None)()
            rounds += 1
            parts = self.world.gather_objects(informative.tolist()) if ranks > 1 else [informative.tolist()]
            every = torch.tensor([flag for part in parts for flag in part], dtype=torch.bool)
            take_all = every & (every.long().cumsum(0) <= need - kept)  # the first ones still missing
            first = sum(len(part) for part in parts[:rank])
            kept += int(take_all.sum())
            if todo:
                take = take_all[first:first + len(informative)].to(rewards.total.device)
                batches.append(dataclasses.replace(batch, rewards=rewards, trained_groups=take))
            if kept >= need or rounds >= self.max_rounds:
                break
            extra = self.prompts.next_batch(need - kept)  # the same on every rank; each samples its slice
            sizes = [len(extra) // ranks + (r < len(extra) % ranks) for r in range(ranks)]
            start = sum(sizes[:rank])
            todo, place = extra[start:start + sizes[rank]], (start, len(extra))
        if kept == 0:  # nothing to learn from: train on the last round as it is (every advantage 0)
            batches[-1] = dataclasses.replace(batches[-1], trained_groups=torch.ones_like(batches[-1].trained_groups))
        merged = concat_rollouts(batches)
        if ranks > 1:
            sampled = self.world.sum(sampled)
        groups = sampled[1] / group_size
        metrics = {"dynamic_sampling/rounds": float(rounds), "dynamic_sampling/groups_sampled": float(groups),
                   "dynamic_sampling/groups_kept": float(kept), "reward/mean_sampled": sampled[0] / max(sampled[1], 1)}
        if rank > 0:  # the trainer sums the ranks' sampler metrics: rank 0 reports the whole step's
            metrics = dict.fromkeys(metrics, 0.0)
        return dataclasses.replace(merged, metrics=MappingProxyType({**merged.metrics, **metrics}))


def select_groups(batch: RolloutBatch, rewards: RewardOutput | None, groups: Tensor
                  ) -> tuple[RolloutBatch, RewardOutput | None]:
    """The groups ``groups`` (indices into B) of a batch and of its rewards."""
    g = batch.group_size
    rows = (groups[:, None] * g + torch.arange(g)[None, :]).flatten()
    logprobs = batch.sampler_logprobs
    pick = lambda r: None if r is None else RewardOutput(  # noqa: E731
        total=r.total[groups], breakdown={k: v[groups] for k, v in r.breakdown.items()}, errors=r.errors)
    picked = RolloutBatch(
        prompts=tuple(batch.prompts[i] for i in groups.tolist()), group_size=g,
        prompt_ids=batch.prompt_ids[rows], prompt_mask=batch.prompt_mask[rows],
        completion_ids=batch.completion_ids[rows], completion_mask=batch.completion_mask[rows],
        is_truncated=batch.is_truncated[rows], texts=tuple(batch.texts[i] for i in rows.tolist()),
        sampler_logprobs=logprobs[rows] if logprobs is not None else None, rewards=pick(batch.rewards),
        trained_groups=batch.trained_groups[groups] if batch.trained_groups is not None else None,
        metrics=batch.metrics,
    )
    return picked, pick(rewards)


def _pad(tensors: Sequence[Tensor], width: int, value: float | int | bool, left: bool) -> Tensor:
    out = []
    for t in tensors:
        pad = t.new_full((t.shape[0], width - t.shape[1]), value)
        out.append(torch.cat([pad, t] if left else [t, pad], dim=1))
    return torch.cat(out)


def concat_rollouts(batches: Sequence[RolloutBatch]) -> RolloutBatch:
    """One batch from several of the same group size (prompts re-left-padded, completions re-right-padded)."""
    if len({b.group_size for b in batches}) != 1:
        raise ValueError(f"cannot concatenate batches of group sizes {[b.group_size for b in batches]}")
    if len(batches) == 1:
        return batches[0]
    p_width = max(b.prompt_ids.shape[1] for b in batches)
    c_width = max(b.completion_ids.shape[1] for b in batches)
    pad_id = 0  # padded positions are masked out everywhere; any valid id will do
    logprobs = [b.sampler_logprobs for b in batches]
    return RolloutBatch(
        prompts=tuple(p for b in batches for p in b.prompts), group_size=batches[0].group_size,
        prompt_ids=_pad([b.prompt_ids for b in batches], p_width, pad_id, left=True),
        prompt_mask=_pad([b.prompt_mask for b in batches], p_width, False, left=True),
        completion_ids=_pad([b.completion_ids for b in batches], c_width, pad_id, left=False),
        completion_mask=_pad([b.completion_mask for b in batches], c_width, False, left=False),
        is_truncated=torch.cat([b.is_truncated for b in batches]),
        texts=tuple(t for b in batches for t in b.texts),
        sampler_logprobs=None if any(lp is None for lp in logprobs) else _pad(logprobs, c_width, 0.0, left=False),
        rewards=None if any(b.rewards is None for b in batches) else concat_rewards([b.rewards for b in batches]),
        trained_groups=None if all(b.trained_groups is None for b in batches) else torch.cat(
            [b.trained_groups if b.trained_groups is not None else torch.ones(b.num_prompts, dtype=torch.bool)
             for b in batches]),
        metrics=MappingProxyType(_summed([b.metrics for b in batches])),  # counts of every round drawn
    )


def concat_rewards(parts: Sequence[RewardOutput]) -> RewardOutput:
    """The rewards of consecutive batches as one: [B_i, G] stacked, error counts summed."""
    return RewardOutput(total=torch.cat([p.total for p in parts]),
                        breakdown={k: torch.cat([p.breakdown[k] for p in parts]) for k in parts[0].breakdown},
                        errors=_summed([p.errors for p in parts]))


def _summed(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            out[key] = out.get(key, 0) + value
    return out
