"""A reasoning-gym family whose difficulty rises with the policy's accuracy: :class:`DifficultyCurriculum`.

The knob is the family's own curriculum (``reasoning_gym.factory.create_curriculum(family)``): level ``L``
is ``set_global_level(L)`` then ``generate_configuration`` (reasoning-gym's default, inclusive ranges:
level ``L`` spans levels 0 to ``L`` of each attribute). The controller is ours, and small:

- A level's problems are drawn when the level is reached, as :func:`reasoning_gym_task` draws them
  (``num_train`` to train on, ``num_test`` held out, distinct by question), and none that an earlier
  level already used, so no held-out question of any level is ever a training question of another.
- Batches come from the current level's training problems in seeded epochs (as ``PromptStream``).
- After each step, the group accuracies (the group mean of ``accuracy_reward``'s scores, partial credit
  included) of the groups drawn at the current level are kept, the last ``window`` of them. Once the
  level has seen ``window`` groups and their mean is >= ``threshold``, the level rises by one (up to
  ``max_level``) and the window empties. It never falls.
- ``state_dict`` holds the level, the window and the place in the epoch; loading it draws the levels
  again from ``start_level`` up, in order, so a resumed run serves exactly what it would have served.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch import Tensor

from grpo_engine.data.curriculum import group_accuracy
from grpo_engine.data.errors import DataError
from grpo_engine.data.stream import EpochOrder
from grpo_engine.tasks.reasoning_gym import (
    check_family,
    draw_splits,
    family_factory,
    require_reasoning_gym,
    to_prompt,
)
from grpo_engine.types import Prompt, RewardOutput, RolloutBatch

__all__ = ["DifficultyCurriculum"]


class DifficultyCurriculum:
    """Prompt source over one reasoning-gym family whose level rises with accuracy (module docstring).

    Args:
        family: a reasoning-gym family with a curriculum (most have one).
        batch_size: prompts per batch when ``next_batch`` is given no size.
        num_train, num_test: training and held-out problems drawn per level.
        seed: seed of every level's problems and of the epochs' order.
        start_level: the first level.
        max_level: the highest level to reach (default: the family curriculum's highest).
        threshold: the mean group accuracy over the window that raises the level, in (0, 1].
        window: how many of the current level's groups that mean is over (>= 1).
        config: fixed configuration fields the curriculum does not set (e.g. ``{"allow_negation": True}``).
        system_prompt: as :func:`reasoning_gym_task`.
        accuracy_reward: the reward (breakdown name) whose group mean is the accuracy; None: the first.

    Example:
        >>> source = DifficultyCurriculum("chain_sum", batch_size=2, num_train=4, num_test=2, window=2,
        ...                               threshold=0.5)
        >>> train, test = source.split()
        >>> source.level, len(source.next_batch()), len(train), len(test)
        (0, 2, 4, 2)
    """

    def __init__(self, family: str, batch_size: int = 8, *, num_train: int = 500, num_test: int = 64,
                 seed: int = 0, start_level: int = 0, max_level: int | None = None, threshold: float = 0.8,
                 window: int = 32, config: Mapping[str, Any] | None = None,
                 system_prompt: str | None = "default", accuracy_reward: str | None = None) -> None:
        rg = require_reasoning_gym()
        from reasoning_gym.factory import create_curriculum, has_curriculum

        check_family(family)
        if not has_curriculum(family):
            raise DataError(f"family={family!r} has no reasoning-gym curriculum, so no level to raise; use "
                            "reasoning_gym_task with a fixed config, or a family with one")
        self.curriculum = create_curriculum(family)
        top = max(len(a.levels) for a in self.curriculum.attributes.values()) - 1
        max_level = top if max_level is None else max_level
        problems = [f"{name}={value!r} must be an int >= {low}" for name, value, low in (
            ("batch_size", batch_size, 1), ("window", window, 1), ("num_train", num_train, 1),
            ("num_test", num_test, 0), ("start_level", start_level, 0))
            if isinstance(value, bool) or not isinstance(value, int) or value < low]
        if not 0 < threshold <= 1:
            problems.append(f"threshold={threshold!r} must be in (0, 1]; e.g. 0.8")
        if not isinstance(max_level, int) or not start_level <= max_level <= top:
            problems.append(f"max_level={max_level!r} must be an int from start_level={start_level!r} to the "
                            f"family's highest level, {top}")
        if problems:
            raise DataError("invalid DifficultyCurriculum: " + "; ".join(problems))
        self.family, self.batch_size, self.seed = family, batch_size, seed
        self.num_train, self.num_test = num_train, num_test
        self.start_level, self.max_level = start_level, max_level
        self.threshold, self.window, self.accuracy_reward = threshold, window, accuracy_reward
        self.config = dict(config or {})
        self.system = rg.utils.SYSTEM_PROMPTS.get(system_prompt, system_prompt) if system_prompt else None
        self._train: list[list[Prompt]] = []  # per level from start_level: training, held-out problems
        self._test: list[list[Prompt]] = []
        self._used: set[str] = set()
        self._recent: list[float] = []
        self._enter(start_level)

    @property
    def level(self) -> int:
        """The level the next batch comes from."""
        return self.start_level + len(self._train) - 1

    @property
    def prompts(self) -> tuple[Prompt, ...]:
        """Every training prompt of the levels reached so far (a later level's are drawn when reached)."""
        return tuple(p for pool in self._train for p in pool)

    def split(self, level: int | None = None) -> tuple[list[Prompt], list[Prompt]]:
        """The training and held-out problems of ``level`` (default: the current one), a level reached.

        Raises:
            ValueError: ``level`` has not been reached.
        """
        level = self.level if level is None else level
        if not self.start_level <= level <= self.level:
            raise ValueError(f"level={level!r} has not been reached; levels {self.start_level}..{self.level} "
                             "have problems so far")
        return list(self._train[level - self.start_level]), list(self._test[level - self.start_level])

    def level_config(self, level: int) -> dict[str, Any]:
        """The family's configuration at ``level`` (without seed and size)."""
        self.curriculum.set_global_level(level)
        made = self.curriculum.generate_configuration(defaults={**self.config, "seed": self.seed, "size": 1})
        return {k: v for k, v in vars(made).items() if k not in ("seed", "size")}

    def next_batch(self, size: int | None = None) -> list[Prompt]:
        """The next ``size`` prompts (default ``batch_size``) of the current level."""
        size = self.batch_size if size is None else size
        if size < 1:
            raise DataError(f"size={size} must be >= 1; ask for at least one prompt")
        pool = self._train[-1]
        return [pool[self._order.take()] for _ in range(size)]

    def observe(self, batch: RolloutBatch, rewards: RewardOutput, uncertainty: Tensor | None = None) -> None:
        """Hears a step's groups (the ``PromptSource`` hook): see :meth:`update`."""
        current = {p.question for p in self._train[-1]}  # distinct across every level
        accuracy = group_accuracy(rewards, self.accuracy_reward).tolist()
        self.update([a for p, a in zip(batch.prompts, accuracy, strict=True) if p.question in current])

    def update(self, accuracies: Sequence[float]) -> bool:
        """Records the group accuracies of the current level's groups; returns whether the level rose."""
        self._recent = (self._recent + [float(a) for a in accuracies])[-self.window:]
        full = len(self._recent) == self.window
        if full and sum(self._recent) / self.window >= self.threshold and self.level < self.max_level:
            self._enter(self.level + 1)
            self._recent = []
            return True
        return False

    def __iter__(self) -> Iterator[list[Prompt]]:
        return self

    def __next__(self) -> list[Prompt]:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """The state to resume exactly (JSON-safe)."""
        return {"family": self.family, "seed": self.seed, "start_level": self.start_level,
                "level": self.level, "window": list(self._recent), "epoch": self._order.epoch,
                "position": self._order.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from a saved state: the levels drawn again up to the saved one, in order.

        Raises:
            DataError: the state is another family's, seed's or start level's, or its level is out of range.
        """
        for key, mine in (("family", self.family), ("seed", self.seed), ("start_level", self.start_level)):
            if state[key] != mine:
                raise DataError(f"state_dict {key}={state[key]!r} but this DifficultyCurriculum has {key}="
                                f"{mine!r}; build it with the saved run's arguments")
        if not self.start_level <= int(state["level"]) <= self.max_level:
            raise DataError(f"state_dict level={state['level']!r} is outside {self.start_level}.."
                            f"{self.max_level}; raise max_level to the saved run's")
        if self.level > int(state["level"]):  # drawn anew from the start: the same problems, in order
            self._train, self._test, self._used = [], [], set()
            self._enter(self.start_level)
        while self.level < int(state["level"]):
            self._enter(self.level + 1)
        self._order.seek(int(state["epoch"]), int(state["position"]))
        self._recent = [float(a) for a in state["window"]]

    def _enter(self, level: int) -> None:
        """Draws ``level``'s problems (none an earlier level used) and starts its epochs."""
        make = family_factory(self.family, self.level_config(level), self.seed)
        train, test = draw_splits(make, self.num_train, self.num_test, exclude=self._used)
        self._used |= {row[0]["question"] for row in train + test}
        self._train.append([to_prompt(*row, self.system) for row in train])
        self._test.append([to_prompt(*row, self.system) for row in test])
        self._order = EpochOrder(len(train), self.seed, f"grpo_engine.DifficultyCurriculum:{level}")
