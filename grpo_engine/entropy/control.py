"""Uses of the per-group (semantic) entropy: an adaptive sampling temperature and a curriculum.

Both consume, per prompt group of a step, the normalised semantic entropy ``SE / log G`` in [0, 1]
(0: every completion gave the same answer; 1: every completion a different one) and the accuracy,
the fraction of the group's G completions judged correct.

* A group is **collapsed** (:func:`collapsed_groups`) when ``SE_norm <= threshold`` and
  ``accuracy < 1``: the completions agree (almost) on one answer, and not all of them are right,
  so the group is confidently wrong (accuracy 0) or agrees on a wrong answer with few exceptions.
  Such a group has (almost) no reward variance, so GRPO learns nothing from it; more exploration
  is the remedy. A group that agrees on the right answer (accuracy 1) is solved, not collapsed.
* :class:`AdaptiveTemperature`, in the spirit of E3-RL4LLMs' dynamic temperature (arXiv
  2505.18573): after each step, raise the temperature by ``step`` when more than
  ``collapse_fraction`` of the groups are collapsed; else lower it by ``step`` when the mean
  normalised SE is at least ``scatter_entropy`` (answers scatter: sampling too hot); else keep it.
  Always clipped to ``[min_temperature, max_temperature]``. Collapse is checked first.
* :class:`InformativeCurriculum`, after HIVE's "learning edge" selection (arXiv 2603.25184) and
  SENT's semantic-entropy curriculum (arXiv 2512.04359), but online: a prompt source that
  remembers each prompt's accuracy and SE across the run and fills part of every batch with the
  seen prompts that are neither solved nor hopeless, instead of a fixed easy-to-hard order.

Both are small stateful objects with ``state_dict()`` / ``load_state_dict()``; they never log.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_engine.types import Prompt

__all__ = ["collapsed_groups", "collapsed_fraction", "AdaptiveTemperature", "InformativeCurriculum", "PromptStats"]


def _pair(name: str, semantic_entropy: Tensor, accuracy: Tensor) -> tuple[Tensor, Tensor]:
    se, acc = torch.as_tensor(semantic_entropy), torch.as_tensor(accuracy)
    if se.dim() != 1 or se.shape != acc.shape or se.numel() == 0:
        raise ValueError(f"{name}: semantic_entropy {tuple(se.shape)} and accuracy {tuple(acc.shape)} must both "
                         "be [B] with B >= 1; pass one value per prompt group")
    dtype = torch.promote_types(se.dtype, torch.float32)
    return se.detach().to(dtype), acc.detach().to(device=se.device, dtype=dtype)


def collapsed_groups(semantic_entropy: Tensor, accuracy: Tensor, threshold: float = 0.1) -> Tensor:
    """[B] bool: True where ``semantic_entropy <= threshold`` and ``accuracy < 1``.

    Args:
        semantic_entropy: [B] normalised semantic entropy (SE / log G, in [0, 1]).
        accuracy: [B] fraction of each group's completions judged correct.
        threshold: the normalised SE at or below which a group's answers count as one.

    Example:
        >>> collapsed_groups(torch.tensor([0.0, 0.0, 0.05, 0.6]), torch.tensor([0.0, 1.0, 0.25, 0.0]))
        tensor([ True, False,  True, False])
    """
    se, acc = _pair("collapsed_groups", semantic_entropy, accuracy)
    return (se <= threshold) & (acc < 1)


def collapsed_fraction(semantic_entropy: Tensor, accuracy: Tensor, threshold: float = 0.1) -> Tensor:
    """Fraction of the B groups that are collapsed (see :func:`collapsed_groups`); a scalar tensor.

    Example:
        >>> collapsed_fraction(torch.tensor([0.0, 0.0, 0.05, 0.6]), torch.tensor([0.0, 1.0, 0.25, 0.0]))
        tensor(0.5000)
    """
    collapsed = collapsed_groups(semantic_entropy, accuracy, threshold)
    return collapsed.to(torch.promote_types(torch.as_tensor(semantic_entropy).dtype, torch.float32)).mean()


class AdaptiveTemperature:
    """Sampling temperature that rises when groups collapse and falls when answers scatter.

    Args:
        initial: the temperature of the first step, within the bounds.
        min_temperature, max_temperature: bounds, 0 < min <= max.
        step: change per update (> 0).
        collapse_entropy: a group with normalised SE at or below this and accuracy < 1 is collapsed.
        scatter_entropy: lower the temperature when the mean normalised SE is at or above this.
        collapse_fraction: raise the temperature when more than this fraction of groups collapsed.

    Example:
        >>> control = AdaptiveTemperature(initial=1.0, step=0.1)
        >>> control.update(torch.tensor([0.0, 0.0, 0.5]), torch.tensor([0.0, 0.0, 0.5]))  # 2/3 collapsed
        1.1
        >>> control.update(torch.tensor([0.9, 1.0]), torch.tensor([0.5, 0.0]))  # scattered
        1.0
    """

    def __init__(self, initial: float = 1.0, min_temperature: float = 0.5, max_temperature: float = 1.5,
                 step: float = 0.05, collapse_entropy: float = 0.1, scatter_entropy: float = 0.8,
                 collapse_fraction: float = 0.5) -> None:
        problems = []
        if not 0 < min_temperature <= max_temperature:
            problems.append(f"min_temperature={min_temperature!r}, max_temperature={max_temperature!r} must "
                            "satisfy 0 < min <= max; e.g. 0.5 and 1.5")
        elif not min_temperature <= initial <= max_temperature:
            problems.append(f"initial={initial!r} must be within [{min_temperature}, {max_temperature}]; start "
                            "from the configured sampling temperature inside the bounds")
        if not step > 0:
            problems.append(f"step={step!r} must be > 0; use e.g. 0.05")
        if not 0 <= collapse_entropy < scatter_entropy:
            problems.append(f"collapse_entropy={collapse_entropy!r}, scatter_entropy={scatter_entropy!r} must "
                            "satisfy 0 <= collapse < scatter (normalised SE); e.g. 0.1 and 0.8")
        if not 0 <= collapse_fraction < 1:
            problems.append(f"collapse_fraction={collapse_fraction!r} must be in [0, 1); e.g. 0.5")
        if problems:
            raise ValueError("invalid AdaptiveTemperature: " + "; ".join(problems))
        self.min_temperature, self.max_temperature = float(min_temperature), float(max_temperature)
        self.step, self.collapse_entropy, self.scatter_entropy = float(step), collapse_entropy, scatter_entropy
        self.collapse_fraction = collapse_fraction
        self._temperature = float(initial)

    @property
    def temperature(self) -> float:
        """The temperature in force: sample (and score log-probs) at it until the next update."""
        return self._temperature

    def update(self, semantic_entropy: Tensor, accuracy: Tensor) -> float:
        """Takes one step's [B] normalised SE and accuracy; returns the temperature for the next step.

        The decision is tensor math; one conversion to a Python float at the end (the sampler
        needs a number), so it synchronises with the device once.
        """
        se, acc = _pair("AdaptiveTemperature.update", semantic_entropy, accuracy)
        collapsed = ((se <= self.collapse_entropy) & (acc < 1)).to(se.dtype).mean()
        scattered = se.mean() >= self.scatter_entropy
        direction = torch.where(collapsed > self.collapse_fraction, 1.0, torch.where(scattered, -1.0, 0.0))
        proposed = round(self._temperature + self.step * float(direction), 12)  # no drift off the step grid
        self._temperature = min(self.max_temperature, max(self.min_temperature, proposed))
        return self._temperature

    def state_dict(self) -> dict[str, float]:
        """``{"temperature": ...}``: the only state (the settings come from the constructor)."""
        return {"temperature": self._temperature}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the temperature; it must lie within this controller's bounds."""
        value = float(state["temperature"])
        if not self.min_temperature <= value <= self.max_temperature:
            raise ValueError(f"state temperature={value!r} is outside [{self.min_temperature}, "
                             f"{self.max_temperature}]; build the controller with the saved run's bounds")
        self._temperature = value


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
                 target_high: float = 0.9, revisit_fraction: float = 0.5, cooldown_batches: int = 1) -> None:
        problems = []
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= len(prompts):
            problems.append(f"batch_size={batch_size!r} must be an int in [1, len(prompts)={len(prompts)}] (a batch "
                            "never holds a prompt twice); pass more prompts or a smaller batch")
        if not 0 <= target_low < target_high <= 1:
            problems.append(f"target_low={target_low!r}, target_high={target_high!r} must satisfy "
                            "0 <= low < high <= 1; e.g. 0.1 and 0.9")
        if not 0 <= revisit_fraction <= 1:
            problems.append(f"revisit_fraction={revisit_fraction!r} must be in [0, 1]; e.g. 0.5")
        if isinstance(cooldown_batches, bool) or not isinstance(cooldown_batches, int) or cooldown_batches < 0:
            problems.append(f"cooldown_batches={cooldown_batches!r} must be an int >= 0; e.g. 1")
        if problems:
            raise ValueError("invalid InformativeCurriculum: " + "; ".join(problems))
        self.prompts: tuple[Prompt, ...] = tuple(prompts)
        self.batch_size, self.seed = batch_size, seed
        self.target_low, self.target_high = target_low, target_high
        self.revisit_fraction, self.cooldown_batches = revisit_fraction, cooldown_batches
        self._index = {id(p): i for i, p in reversed(list(enumerate(self.prompts)))}
        n = len(self.prompts)
        self._visits, self._accuracy_sum = [0] * n, [0.0] * n
        self._last_accuracy: list[float | None] = [None] * n
        self._last_se: list[float | None] = [None] * n
        self._last_served = [-1] * n
        self._epoch = self._position = self._batches = 0
        self._order = self._permutation(0)

    @property
    def epoch(self) -> int:
        """The epoch of the pass the next fresh prompt comes from (0: the unseen prompts)."""
        return self._epoch

    @property
    def position(self) -> int:
        """How many prompts of the current pass have been consumed."""
        return self._position

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
            if self._position == len(self.prompts):
                self._epoch, self._position = self._epoch + 1, 0
                self._order = self._permutation(self._epoch)
            i = self._order[self._position]
            self._position += 1
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
            raise ValueError(f"update: accuracy {acc} must lie in [0, 1] (the fraction of correct completions)")
        for k, prompt in enumerate(prompts):
            i = self._lookup(prompt)
            self._visits[i] += 1
            self._accuracy_sum[i] += acc[k]
            self._last_accuracy[i] = acc[k]
            if se is not None:
                self._last_se[i] = se[k]

    def __iter__(self) -> Iterator[list[Prompt]]:
        return self

    def __next__(self) -> list[Prompt]:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Everything to resume exactly: the pass position and every prompt's statistics (JSON-safe)."""
        return {"seed": self.seed, "num_prompts": len(self.prompts), "epoch": self._epoch,
                "position": self._position, "batches": self._batches, "visits": list(self._visits),
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
            raise ValueError(f"state_dict epoch={state['epoch']}, position={state['position']} is out of range "
                             f"for {n} prompts; pass a state saved by InformativeCurriculum.state_dict()")
        self._epoch, self._position, self._batches = int(state["epoch"]), int(state["position"]), int(state["batches"])
        self._visits = [int(v) for v in state["visits"]]
        self._accuracy_sum = [float(v) for v in state["accuracy_sum"]]
        self._last_accuracy = list(state["last_accuracy"])
        self._last_se = list(state["last_semantic_entropy"])
        self._last_served = [int(v) for v in state["last_served"]]
        self._order = self._permutation(self._epoch)

    def _lookup(self, prompt: Prompt) -> int:
        i = self._index.get(id(prompt))
        if i is not None and self.prompts[i] is prompt:
            return i
        for i, candidate in enumerate(self.prompts):
            if candidate == prompt:
                return i
        raise ValueError(f"update: prompt {prompt.question[:60]!r} is not one of this curriculum's prompts; pass "
                         "the prompts next_batch returned (RolloutBatch.prompts)")

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(f"grpo_engine.InformativeCurriculum:{self.seed}:{epoch}").shuffle(order)
        return order
