"""A plain function as a reward, written as TRL users write one:

    def reward(prompts, completions, **columns) -> list[float | None]

called with keyword arguments (so ``def reward(completions, **kwargs)`` works too): ``prompts`` are
the prompts' contents (text, or a list of chat messages), ``completions`` the decoded
completions, and ``columns`` every metadata column of the prompts (a dataset's other columns, e.g.
``answer``) plus ``target``, each a list with one value per completion. ``None`` means "does not
apply to this sample": it is left out of that sample's weighted sum (the sample's other rewards
still count) and out of the reward's logged mean, and counted in ``reward/<name>/none``. With tools
(a multi-turn batch), ``completions`` are the model's last turns, and the columns add ``conversations``
(each rollout's messages after the prompt) and ``environments`` (each rollout's environment, or None).
``WeightedSum`` (hence the trainer) wraps a plain function in :class:`FunctionReward` itself.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from grpo_engine.rewards.base import RewardError, check_weight, excerpt
from grpo_engine.types import Episode, Prompt

__all__ = ["FunctionReward"]


class FunctionReward:
    """Wraps ``fn(prompts, completions, **columns) -> list[float | None]`` as a ``RewardFn``.

    Args:
        fn: the function (see the module docstring).
        weight: its multiplier in the weighted sum.
        name: the key in logs; defaults to the function's name.

    Example:
        >>> def brevity(prompts, completions, **columns):
        ...     return [1.0 if len(c) < 8 else None for c in completions]
        >>> FunctionReward(brevity)([Prompt("q"), Prompt("q")], ["ok", "far too long"])
        tensor([1., nan])
    """

    allows_none = True  # WeightedSum: a NaN score is "does not apply", not an error
    reads_episodes = True  # the runner passes a multi-turn batch's episodes

    def __init__(self, fn: Callable[..., Sequence[float | None]], weight: float = 1.0,
                 name: str | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"FunctionReward needs a function, got {type(fn).__name__}")
        self.fn = fn
        self.weight = check_weight(weight, "FunctionReward")
        self.name = name if name is not None else getattr(fn, "__name__", type(fn).__name__)
        if not isinstance(self.name, str) or not self.name.strip() or self.name == "<lambda>":
            raise ValueError(f"FunctionReward: name={self.name!r} cannot key the logs; pass name='my_reward'")

    def __repr__(self) -> str:
        return f"FunctionReward({getattr(self.fn, '__qualname__', self.fn)!r}, weight={self.weight!r}, " \
               f"name={self.name!r})"

    def __call__(self, prompts: Sequence[Prompt], completions: Sequence[str],
                 episodes: Sequence[Episode] | None = None) -> Tensor:
        """[N] float32 scores, NaN where the function returned None; ``episodes``: a multi-turn batch's
        (passed on as the ``conversations`` and ``environments`` columns)."""
        if len(prompts) != len(completions):
            raise ValueError(f"reward {self.name!r}: got {len(prompts)} prompts and {len(completions)} "
                             "completions")
        contents = [list(p.content) if isinstance(p.content, tuple) else p.content for p in prompts]
        try:
            extra = {} if episodes is None else {"conversations": [list(e.messages) for e in episodes],
                                                 "environments": [e.environment for e in episodes]}
            scores = list(self.fn(prompts=contents, completions=list(completions), **columns(prompts),
                                  **extra))
        except Exception as exc:
            raise RewardError(f"reward {self.name!r} (function {getattr(self.fn, '__qualname__', self.fn)}) "
                              f"raised {type(exc).__name__} on a batch of {len(completions)} samples: "
                              f"{exc}") from exc
        if len(scores) != len(completions):
            raise RewardError(f"reward {self.name!r} returned {len(scores)} scores for {len(completions)} "
                              "completions; return one score (or None) per completion")
        out = []
        # None is "does not apply"; a NaN the function computed is an error
        for i, value in enumerate(scores):
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                      or not math.isfinite(value)):
                raise RewardError(f"reward {self.name!r} returned {value!r} for sample {i} (completion="
                                  f"{excerpt(completions[i])}); return a finite number, or None when it does "
                                  "not apply")
            out.append(math.nan if value is None else float(value))
        return torch.tensor(out, dtype=torch.float32)


def columns(prompts: Sequence[Prompt]) -> dict[str, list[Any]]:
    """Every metadata column of the prompts, one value per prompt (None where a prompt lacks it), and
    ``target``."""
    keys: dict[str, None] = {}
    for prompt in prompts:
        keys.update(dict.fromkeys(prompt.metadata))
    out = {key: [p.metadata.get(key) for p in prompts] for key in keys
           if key not in ("prompts", "completions")}
    out["target"] = [p.target for p in prompts]
    return out
