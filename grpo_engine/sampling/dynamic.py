"""DAPO dynamic sampling: train only on groups that carry a learning signal.

DAPO (Yu et al. 2025, arXiv 2503.14476, section 3.2) drops every group whose rewards are all equal
(all right or all wrong: every advantage is 0, so the group adds nothing to the gradient but
still dilutes the step) and keeps sampling fresh prompts until the batch is full again.

Rules implemented by :class:`DynamicSampling`:

- A group is kept iff its rewards are not all equal: the total reward by default, or one
  reward of the breakdown with ``key`` (``key="math_accuracy"`` keeps exactly DAPO's
  0 < accuracy < 1 even when other rewards, such as an overlong penalty, vary within a group).
- Round 1 samples ``B`` prompts. Each further round samples as many fresh prompts as groups are
  still missing, up to ``max_rounds`` rounds in all (the bound keeps a step's cost finite when the
  task is far too easy or too hard).
- The step trains on the first ``B`` kept groups. After ``max_rounds`` it trains on the kept groups
  it has (fewer than ``B``; the loss normalises by the real counts). When no group was kept, the
  last round's batch is returned as it is: every advantage is 0 and the step changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_engine.types import RewardOutput, RolloutBatch

__all__ = ["DynamicSampling", "concat_rollouts", "select_groups"]

Draw = Callable[[int], tuple[RolloutBatch, RewardOutput]]  # k prompts -> their scored groups


@dataclass(frozen=True)
class DynamicSampling:
    """Keeps sampling until ``num_prompts`` groups with unequal rewards are found (DAPO).

    Args:
        max_rounds: sampling rounds per step at most (>= 1; 1 only filters).
        key: the breakdown reward to filter on (e.g. "math_accuracy"); None filters on the total.

    Example:
        >>> # trainer = GRPOTrainer(..., dynamic_sampling=DynamicSampling(max_rounds=3))
    """

    max_rounds: int = 3
    key: str | None = None

    def __post_init__(self) -> None:
        if self.max_rounds < 1:
            raise ValueError(f"max_rounds={self.max_rounds} must be >= 1; use e.g. 3")

    def __call__(self, draw: Draw, num_prompts: int) -> tuple[RolloutBatch, RewardOutput, dict[str, float]]:
        """Returns the batch to train on, its rewards, and counts for the logs.

        Args:
            draw: samples and scores ``k`` fresh prompts.
            num_prompts: B, the groups a full step trains on.
        """
        kept_batches: list[RolloutBatch] = []
        kept_rewards: list[RewardOutput] = []
        kept = sampled = rounds = 0
        all_totals: list[Tensor] = []
        batch = rewards = None
        while kept < num_prompts and rounds < self.max_rounds:
            batch, rewards = draw(num_prompts if rounds == 0 else num_prompts - kept)
            rounds += 1
            sampled += batch.num_prompts
            all_totals.append(rewards.total.reshape(-1))
            if self.key is not None and self.key not in rewards.breakdown:
                raise KeyError(f"DynamicSampling(key={self.key!r}) but the rewards are "
                               f"{sorted(rewards.breakdown)}; use one of those names or key=None")
            signal = rewards.total if self.key is None else rewards.breakdown[self.key]
            informative = (signal != signal[:, :1]).any(dim=1).nonzero().flatten()
            informative = informative[: num_prompts - kept]
            if informative.numel():
                kept_batch, kept_reward = select_groups(batch, rewards, informative)
                kept_batches.append(kept_batch)
                kept_rewards.append(kept_reward)
                kept += informative.numel()
        assert batch is not None and rewards is not None
        stats = {
            "dynamic_sampling/rounds": float(rounds),
            "dynamic_sampling/groups_sampled": float(sampled),
            "dynamic_sampling/groups_kept": float(kept),
            "reward/mean_sampled": torch.cat(all_totals).float().mean().item(),
        }
        if not kept_batches:
            return batch, rewards, stats
        return concat_rollouts(kept_batches), _concat_rewards(kept_rewards), stats


def select_groups(batch: RolloutBatch, rewards: RewardOutput, groups: Tensor) -> tuple[RolloutBatch, RewardOutput]:
    """The groups ``groups`` (indices into B) of a batch and of its rewards."""
    g = batch.group_size
    rows = (groups[:, None] * g + torch.arange(g)[None, :]).flatten()
    logprobs = batch.sampler_logprobs
    picked = RolloutBatch(
        prompts=tuple(batch.prompts[i] for i in groups.tolist()), group_size=g,
        prompt_ids=batch.prompt_ids[rows], prompt_mask=batch.prompt_mask[rows],
        completion_ids=batch.completion_ids[rows], completion_mask=batch.completion_mask[rows],
        is_truncated=batch.is_truncated[rows], texts=tuple(batch.texts[i] for i in rows.tolist()),
        sampler_logprobs=logprobs[rows] if logprobs is not None else None,
    )
    return picked, RewardOutput(total=rewards.total[groups],
                                breakdown={k: v[groups] for k, v in rewards.breakdown.items()})


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
    )


def _concat_rewards(parts: Sequence[RewardOutput]) -> RewardOutput:
    return RewardOutput(total=torch.cat([p.total for p in parts]),
                        breakdown={k: torch.cat([p.breakdown[k] for p in parts]) for k in parts[0].breakdown})
