"""A prompt source that revisits the prompts the policy is still learning on (online curriculum).

After HIVE's "learning edge" selection (arXiv 2603.25184) and SENT's semantic-entropy curriculum
(arXiv 2512.04359), but online: :class:`InformativeCurriculum` remembers each prompt's accuracy
(and normalised semantic entropy) across the run and fills part of every batch with the seen
prompts that are neither solved nor hopeless; the rest comes from a seeded pass over all prompts
(:class:`~grpo_engine.data.stream.EpochOrder`, as ``PromptStream``). It implements ``PromptSource``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_engine.data.stream import EpochOrder
from grpo_engine.types import Prompt, RewardOutput, RolloutBatch

__all__ = ["InformativeCurriculum", "PromptStats", "group_accuracy"]


def group_accuracy(rewards: RewardOutput, name: str | None = None) -> Tensor:
    """[B] group mean of the reward ``name`` of the breakdown (None: the first one).

    Raises:
        KeyError: ``name`` is not a reward of the breakdown.
        ValueError: it returned None for some samples.
    """
    if not rewards.breakdown:
        raise KeyError("the rewards have no breakdown; score them with WeightedSum")
    key = name if name is not None else next(iter(rewards.breakdown))
    if key not in rewards.breakdown:
        raise KeyError(f"accuracy_reward={key!r} is not one of the rewards {sorted(rewards.breakdown)}; "
                       "pass one of those names")
    return rewards.scored(key, f"accuracy_reward={key!r}").float().mean(dim=1)


@dataclass(frozen=True)
class PromptStats:
    """What :class:`InformativeCurriculum` remembers of one prompt.

    Attributes:
        visits: how many times its statistics were updated (groups scored).
        mean_accuracy: mean of the accuracies of those visits (None before the first).
        last_accuracy: the most recent accuracy (None before the first).
        last_semantic_entropy: the most recent normalised SE given (None if never given).
        last_served: index of the last batch it was served in (-1: never).
    """

    visits: int = 0
    mean_accuracy: float | None = None
    last_accuracy: float | None = None
    last_semantic_entropy: float | None = None
    last_served: int = -1


class InformativeCurriculum:
    """Prompt source that revisits the prompts the policy is still learning on.

    Same interface as :class:`grpo_engine.data.PromptStream` (``next_batch``, iteration,
    ``epoch``, ``position``, ``state_dict``, ``load_state_dict``), plus :meth:`update`, which
    records each scored group's accuracy (and normalised SE) for its prompt.

    A batch of ``size`` prompts is drawn as follows (batch index t = batches served before it):

    1. Revisits, at most ``floor(revisit_fraction * size)``: prompts with at least one update
       whose mean accuracy lies strictly inside ``(target_low, target_high)`` (so never hopeless
       nor solved ones) and that were not served in the last ``cooldown_batches`` batches
       (t - last_served > cooldown_batches). Most informative first: mean accuracy closest to
       0.5 (distances rounded to 1e-9, so 0.25 and 0.75 tie), then higher last SE (a prompt
       without SE after those with one), then a random order seeded by ``(seed, t)``.
    2. The rest from a pass over a seeded permutation of all prompts, as ``PromptStream``
       serves epochs (permutation ``(seed, epoch)``): while epoch 0 lasts these are exactly the
       prompts never served (unseen prompts come first); afterwards, fresh passes over all. A
       prompt of the pass that is already in the batch is consumed and skipped, so no batch
       ever holds a prompt twice.

    Prompts are identified by their position in ``prompts``: frozen ``Prompt`` records hold a
    mapping (``metadata``), so they are not hashable. :meth:`update` looks each given prompt
    up by object identity (the objects ``next_batch`` returned, which the sampler carries into
    ``RolloutBatch.prompts``), and otherwise by equality (the first equal prompt). Pass distinct
    prompt objects.

    The mean accuracy is over every visit of the run (not a moving average).

    Args:
        prompts: the training prompts (at least ``batch_size`` of them).
        batch_size: prompts per batch (B), at most ``len(prompts)``.
        seed: seed of the permutations and of the revisit tie-breaking.
        target_low, target_high: the informative band of mean accuracy, 0 <= low < high <= 1.
        revisit_fraction: share of each batch reserved for revisits, in [0, 1].
        cooldown_batches: batches a prompt must sit out before it can be revisited (>= 0).
        accuracy_reward: the reward (breakdown name) whose group mean is a prompt's accuracy in
            :meth:`observe`; None: the first reward.

    Example:
        >>> prompts = [Prompt(str(i)) for i in range(6)]
        >>> curriculum = InformativeCurriculum(prompts, batch_size=2, seed=0)
        >>> first = curriculum.next_batch()
        >>> curriculum.update(first, torch.tensor([0.5, 1.0]))
        >>> _ = curriculum.next_batch()  # cooldown: the informative prompt sits out one batch
        >>> first[0] in curriculum.next_batch()
        True
    """

    def __init__(self, prompts: Sequence[Prompt], batch_size: int, seed: int = 0, target_low: float = 0.1,
                 target_high: float = 0.9, revisit_fraction: float = 0.5, cooldown_batches: int = 1,
                 accuracy_reward: str | None = None) -> None:
        problems = []
        if (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                or not 1 <= batch_size <= len(prompts)):
            problems.append(f"batch_size={batch_size!r} must be an int in [1, len(prompts)={len(prompts)}] "
                            "(a batch never holds a prompt twice); pass more prompts or a smaller batch")
        if not 0 <= target_low < target_high <= 1:
            problems.append(f"target_low={target_low!r}, target_high={target_high!r} must satisfy "
                            "0 <= low < high <= 1; e.g. 0.1 and 0.9")
        if not 0 <= revisit_fraction <= 1:
            problems.append(f"revisit_fraction={revisit_fraction!r} must be in [0, 1]; e.g. 0.5")
        if (isinstance(cooldown_batches, bool) or not isinstance(cooldown_batches, int)
                or cooldown_batches < 0):
            problems.append(f"cooldown_batches={cooldown_batches!r} must be an int >= 0; e.g. 1")
        if problems:
            raise ValueError("invalid InformativeCurriculum: " + "; ".join(problems))
        self.prompts: tuple[Prompt, ...] = tuple(prompts)
        self.batch_size, self.seed = batch_size, seed
        self.target_low, self.target_high = target_low, target_high
        self.revisit_fraction, self.cooldown_batches = revisit_fraction, cooldown_batches
        self.accuracy_reward = accuracy_reward
        self._index = {id(p): i for i, p in reversed(list(enumerate(self.prompts)))}
        n = len(self.prompts)
        self._visits, self._accuracy_sum = [0] * n, [0.0] * n
        self._last_accuracy: list[float | None] = [None] * n
        self._last_se: list[float | None] = [None] * n
        self._last_served = [-1] * n
        self._batches = 0
        self._pass = EpochOrder(n, seed, "grpo_engine.InformativeCurriculum")

    @property
    def epoch(self) -> int:
        """The epoch of the pass the next fresh prompt comes from (0: the unseen prompts)."""
        return self._pass.epoch

    @property
    def position(self) -> int:
        """How many prompts of the current pass have been consumed."""
        return self._pass.position

    def stats(self, prompt: Prompt | int) -> PromptStats:
        """The statistics of a prompt (or of the prompt at that position)."""
        i = prompt if isinstance(prompt, int) else self._lookup(prompt)
        visits = self._visits[i]
        return PromptStats(visits, self._accuracy_sum[i] / visits if visits else None, self._last_accuracy[i],
                           self._last_se[i], self._last_served[i])

    def informative(self) -> list[int]:
        """Positions of the seen prompts whose mean accuracy is inside the target band."""
        return [i for i, v in enumerate(self._visits)
                if v and self.target_low < self._accuracy_sum[i] / v < self.target_high]

    def next_batch(self, size: int | None = None) -> list[Prompt]:
        """Returns ``size`` distinct prompts (default ``batch_size``): revisits, then the pass."""
        size = self.batch_size if size is None else size
        if not 1 <= size <= len(self.prompts):
            raise ValueError(f"size={size} must be in [1, {len(self.prompts)}] (distinct prompts per batch)")
        t = self._batches
        ready = [i for i in self.informative()
                 if self._last_served[i] < 0 or t - self._last_served[i] > self.cooldown_batches]
        tie = random.Random(f"grpo_engine.InformativeCurriculum:{self.seed}:revisit:{t}")
        keys = {i: (round(abs(self._accuracy_sum[i] / self._visits[i] - 0.5), 9),
                    -(self._last_se[i] if self._last_se[i] is not None else -math.inf), tie.random())
                for i in ready}
        chosen = sorted(ready, key=keys.__getitem__)[:math.floor(self.revisit_fraction * size)]
        taken = set(chosen)
        while len(chosen) < size:
            i = self._pass.take()
            if i not in taken:
                chosen.append(i)
                taken.add(i)
        for i in chosen:
            self._last_served[i] = t
        self._batches += 1
        return [self.prompts[i] for i in chosen]

    def update(self, prompts: Sequence[Prompt], accuracy: Tensor | Sequence[float],
               semantic_entropy: Tensor | Sequence[float] | None = None) -> None:
        """Records one scored group per prompt.

        Args:
            prompts: the B prompts scored (``RolloutBatch.prompts``).
            accuracy: [B] fraction of each group's completions judged correct, in [0, 1].
            semantic_entropy: [B] normalised SE of each group, or None (the last SE is kept).
        """
        acc = [float(a) for a in torch.as_tensor(accuracy, dtype=torch.float64).reshape(-1).tolist()]
        se = None if semantic_entropy is None else torch.as_tensor(
            semantic_entropy, dtype=torch.float64).reshape(-1).tolist()
        if len(acc) != len(prompts) or (se is not None and len(se) != len(prompts)):
            raise ValueError(f"update: got {len(prompts)} prompts, {len(acc)} accuracies and "
                             f"{'no' if se is None else len(se)} entropies; pass one value per prompt")
        if not all(0 <= a <= 1 for a in acc):
            raise ValueError(f"update: accuracy {acc} must lie in [0, 1] "
                             "(the fraction of correct completions)")
        for k, prompt in enumerate(prompts):
            i = self._lookup(prompt)
            self._visits[i] += 1
            self._accuracy_sum[i] += acc[k]
            self._last_accuracy[i] = acc[k]
            if se is not None:
                self._last_se[i] = se[k]

    def observe(self, batch: RolloutBatch, rewards: RewardOutput, uncertainty: Tensor | None = None) -> None:
        """Records every group of a step (the ``PromptSource`` hook): accuracy is the group mean of
        ``accuracy_reward``, the SE the trainer's per-group uncertainty (normalised SE), if any."""
        self.update(batch.prompts, group_accuracy(rewards, self.accuracy_reward), uncertainty)

    def __iter__(self) -> Iterator[list[Prompt]]:
        return self

    def __next__(self) -> list[Prompt]:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Everything to resume exactly: the pass position and every prompt's statistics (JSON-safe)."""
        return {"seed": self.seed, "num_prompts": len(self.prompts), "epoch": self._pass.epoch,
                "position": self._pass.position, "batches": self._batches, "visits": list(self._visits),
                "accuracy_sum": list(self._accuracy_sum), "last_accuracy": list(self._last_accuracy),
                "last_semantic_entropy": list(self._last_se), "last_served": list(self._last_served)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from a saved state; the prompts and seed must be those it was saved with."""
        n = len(self.prompts)
        for key, mine in (("seed", self.seed), ("num_prompts", n)):
            if state[key] != mine:
                raise ValueError(f"state_dict {key}={state[key]!r} but this InformativeCurriculum has "
                                 f"{key}={mine!r}; build it from the same prompts and seed as the saved run")
        if not 0 <= int(state["position"]) <= n or int(state["epoch"]) < 0:
            raise ValueError(f"state_dict epoch={state['epoch']}, position={state['position']} "
                             f"is out of range for {n} prompts; "
                             "pass a state saved by InformativeCurriculum.state_dict()")
        self._pass.seek(int(state["epoch"]), int(state["position"]))
        self._batches = int(state["batches"])
        self._visits = [int(v) for v in state["visits"]]
        self._accuracy_sum = [float(v) for v in state["accuracy_sum"]]
        self._last_accuracy = list(state["last_accuracy"])
        self._last_se = list(state["last_semantic_entropy"])
        self._last_served = [int(v) for v in state["last_served"]]

    def _lookup(self, prompt: Prompt) -> int:
        i = self._index.get(id(prompt))
        if i is not None and self.prompts[i] is prompt:
            return i
        for i, candidate in enumerate(self.prompts):
            if candidate == prompt:
                return i
        raise ValueError(f"update: prompt {prompt.question[:60]!r} is not one of this curriculum's prompts; "
                         "pass the prompts next_batch returned (RolloutBatch.prompts)")
