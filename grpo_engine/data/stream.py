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

from grpo_engine.data.errors import DataError
from grpo_engine.types import Prompt

__all__ = ["PromptStream", "EpochOrder"]


class EpochOrder:
    """A seeded, endless pass over ``n`` positions: one permutation per epoch, drawn by
    ``random.Random`` seeded with the string ``"{namespace}:{seed}:{epoch}"`` (stable across processes
    and Python versions). Shared by :class:`PromptStream` and the curriculum.

    Example:
        >>> order = EpochOrder(3, seed=0, namespace="doc")
        >>> sorted(order.take() for _ in range(3)), order.epoch, order.position
        ([0, 1, 2], 0, 3)
    """

    def __init__(self, n: int, seed: int, namespace: str) -> None:
        self.n, self.seed, self.namespace = n, seed, namespace
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def take(self) -> int:
        """The next position, starting the next epoch's permutation when this one is used up."""
        if self.position == self.n:
            self.seek(self.epoch + 1, 0)
        i = self._order[self.position]
        self.position += 1
        return i

    def seek(self, epoch: int, position: int) -> None:
        """Continues from ``position`` positions into ``epoch``'s permutation."""
        if epoch != self.epoch or not hasattr(self, "_order"):
            self._order = self._permutation(epoch)
        self.epoch, self.position = epoch, position

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.n))
        random.Random(f"{self.namespace}:{self.seed}:{epoch}").shuffle(order)
        return order


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
        self._pass = EpochOrder(len(self.prompts), seed, "grpo_engine.PromptStream")

    @property
    def epoch(self) -> int:
        """The epoch the next prompt comes from (0 at the start)."""
        return self._pass.epoch

    @property
    def position(self) -> int:
        """How many prompts of the current epoch have been served."""
        return self._pass.position

    def next_batch(self, size: int | None = None) -> list[Prompt]:
        """Returns the next ``size`` prompts (default ``batch_size``), crossing into the next epoch if
        needed."""
        size = self.batch_size if size is None else size
        if size < 1:
            raise DataError(f"size={size} must be >= 1; ask for at least one prompt")
        return [self.prompts[self._pass.take()] for _ in range(size)]

    def __iter__(self) -> Iterator[list[Prompt]]:
        return self

    def __next__(self) -> list[Prompt]:
        return self.next_batch()

    def observe(self, batch: Any, rewards: Any, uncertainty: Any = None) -> None:
        """A plain stream serves every prompt in turn, whatever the results (the ``PromptSource`` hook)."""

    def state_dict(self) -> dict[str, int]:
        """The state to checkpoint: ``{"seed", "epoch", "position", "num_prompts"}``."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
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
        self._pass.seek(epoch, position)
