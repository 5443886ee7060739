"""An endless, seeded, resumable stream of prompt batches.

Implemented: ``PromptStream`` serves the prompts in epochs. Each epoch is a fresh permutation
drawn by ``random.Random`` seeded from ``(seed, epoch)`` (string seeding, stable across
processes and Python versions), so within an epoch no prompt is served twice. A batch that
crosses an epoch boundary is completed from the next epoch's permutation. The whole state is
``(epoch, position)``: ``state_dict()`` saves it and ``load_state_dict()`` continues the exact
same sequence of batches.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

from grpo_engine.data.loaders import DataError
from grpo_engine.types import Prompt

__all__ = ["PromptStream"]


class PromptStream:
    """Endless iterator over shuffled batches of prompts, one permutation per epoch.

    Args:
        prompts: the prompts to serve (at least one).
        batch_size: prompts per batch (B). It may exceed ``len(prompts)``; a batch then spans
            epochs and holds some prompts more than once.
        seed: seed of the per-epoch permutations.

    Attributes:
        epoch: the epoch the next prompt comes from (0 at the start).
        position: how many prompts of that epoch have been served.

    Example:
        >>> stream = PromptStream([Prompt("a"), Prompt("b"), Prompt("c")], batch_size=2)
        >>> sorted(p.question for p in stream.next_batch() + stream.next_batch()[:1])
        ['a', 'b', 'c']
        >>> stream.epoch, stream.position
        (1, 1)
    """

    def __init__(self, prompts: Sequence[Prompt], batch_size: int, seed: int = 0) -> None:
        if len(prompts) == 0:
            raise DataError(
                "PromptStream got no prompts; pass a non-empty list (check the loader's path "
                "and limit, or the num_train of a synthetic task)"
            )
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise DataError(
                f"batch_size={batch_size!r} must be an int >= 1 (the prompts per step, B)"
            )
        self.prompts: tuple[Prompt, ...] = tuple(prompts)
        self.batch_size = batch_size
        self.seed = seed
        self._epoch = 0
        self._position = 0
        self._order = self._permutation(0)

    @property
    def epoch(self) -> int:
        """The epoch the next prompt comes from (0 at the start)."""
        return self._epoch

    @property
    def position(self) -> int:
        """How many prompts of the current epoch have been served."""
        return self._position

    def next_batch(self, size: int | None = None) -> list[Prompt]:
        """Returns the next ``size`` prompts (default ``batch_size``), crossing into the next epoch if needed."""
        size = self.batch_size if size is None else size
        if size < 1:
            raise DataError(f"size={size} must be >= 1; ask for at least one prompt")
        batch: list[Prompt] = []
        while len(batch) < size:
            if self._position == len(self.prompts):
                self._epoch += 1
                self._position = 0
                self._order = self._permutation(self._epoch)
            take = min(size - len(batch), len(self.prompts) - self._position)
            start, self._position = self._position, self._position + take
            batch.extend(self.prompts[i] for i in self._order[start : self._position])
        return batch

    def __iter__(self) -> Iterator[list[Prompt]]:
        return self

    def __next__(self) -> list[Prompt]:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """The state to checkpoint: ``{"seed", "epoch", "position", "num_prompts"}``."""
        return {
            "seed": self.seed,
            "epoch": self._epoch,
            "position": self._position,
            "num_prompts": len(self.prompts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from a saved state; the prompts and seed must be those it was saved with.

        Raises:
            DataError: the state's seed or prompt count differs from this stream's, or its
                position is out of range.
        """
        for key, mine in (("seed", self.seed), ("num_prompts", len(self.prompts))):
            if state[key] != mine:
                raise DataError(
                    f"state_dict {key}={state[key]!r} but this PromptStream has {key}={mine!r}; "
                    "build the stream from the same prompts and seed as the saved run"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.prompts):
            raise DataError(
                f"state_dict epoch={epoch}, position={position} is out of range for "
                f"{len(self.prompts)} prompts; pass a state saved by PromptStream.state_dict()"
            )
        self._epoch, self._position = epoch, position
        self._order = self._permutation(epoch)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(f"grpo_engine.PromptStream:{self.seed}:{epoch}").shuffle(order)
        return order
