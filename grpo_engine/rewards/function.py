"""A plain function as a reward, written as TRL users write one:

    def reward(prompts, completions, **kwargs) -> list[float | None]

called with keyword arguments, as TRL 1.16's ``GRPOTrainer`` calls it (so ``def reward(completions,
**kwargs)`` works, and so do the functions of ``trl.rewards``):

- ``prompts``: the prompts' contents, text or a list of chat messages.
- ``completions``: as TRL passes them. Text when the prompts are text; when they are chat messages, each
  completion as messages, ``[{"role": "assistant", "content": text}]`` (with tools: every message of
  the rollout after the prompt, the tools' replies included). ``FunctionReward(fn,
  conversational=False)`` passes text always.
- ``completion_ids``: each completion's sampled token ids (EOS included when sampled).
- ``trainer_state``: the run's :class:`~grpo_engine.callbacks.TrainerState` (``global_step``,
  ``max_steps``), or None outside a trainer.
- ``log_metric(name, value)``: a number for this batch's log, as ``reward/<reward>/<name>``;
  ``log_extra(column, values)``: accepted and not kept (TRL's completions table has no
  counterpart here).
- every metadata column of the prompts (a dataset's other columns, e.g. ``answer`` or ``solution``)
  plus ``target``, each a list with one value per completion; with tools, also ``conversations``
  (each rollout's messages after the prompt), ``environments`` (each rollout's environment, or
  None) and ``episode_ends`` (how each rollout ended, ``Episode.end``: ``"answered"``, ``"turn_limit"``,
  ``"token_limit"``, ``"reply_too_long"`` or ``"tool_timeout"``).

An ``async def`` function is awaited (one at a time; TRL awaits several side by side).

A score is a number (``bool`` counts as 0 or 1) or ``None``, "does not apply to this sample": it is left
out of that sample's weighted sum (the sample's other rewards still count) and out of the reward's
logged mean, and counted in ``reward/<name>/none``. ``WeightedSum`` (hence the trainer) wraps a plain
function in :class:`FunctionReward` itself.
"""

from __future__ import annotations

import asyncio
import inspect
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
        conversational: completions as chat messages when the prompts are messages (None: TRL's rule),
            always (True), or never (False: text).

    Example:
        >>> def brevity(prompts, completions, **columns):
        ...     return [1.0 if len(c) < 8 else None for c in completions]
        >>> FunctionReward(brevity)([Prompt("q"), Prompt("q")], ["ok", "far too long"])
        tensor([1., nan])
    """

    allows_none = True  # WeightedSum: a NaN score is "does not apply", not an error
    reads_episodes = True  # the runner passes a multi-turn batch's episodes
    reads_tokens = True  # ... and completion_ids, trainer_state

    def __init__(self, fn: Callable[..., Sequence[float | None]], weight: float = 1.0,
                 name: str | None = None, conversational: bool | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"FunctionReward needs a function, got {type(fn).__name__}")
        self.fn = fn
        self.weight = check_weight(weight, "FunctionReward")
        self.name = name if name is not None else getattr(fn, "__name__", type(fn).__name__)
        if not isinstance(self.name, str) or not self.name.strip() or self.name == "<lambda>":
            raise ValueError(f"FunctionReward: name={self.name!r} cannot key the logs; pass name='my_reward'")
        if conversational not in (None, True, False):
            raise ValueError(f"FunctionReward: conversational={conversational!r} must be None (completions "
                             "as messages when the prompts are messages, as TRL), True or False")
        self.conversational = conversational
        self._metrics: dict[str, list[float]] = {}

    def __repr__(self) -> str:
        return f"FunctionReward({getattr(self.fn, '__qualname__', self.fn)!r}, weight={self.weight!r}, " \
               f"name={self.name!r})"

    def __call__(self, prompts: Sequence[Prompt], completions: Sequence[str],
                 episodes: Sequence[Episode] | None = None, *,
                 completion_ids: Sequence[list[int]] | None = None, trainer_state: Any = None) -> Tensor:
        """[N] float32 scores, NaN where the function returned None; ``episodes``: a multi-turn batch's
        (passed on as the ``conversations``, ``environments`` and ``episode_ends`` columns);
        ``completion_ids`` and ``trainer_state`` as the runner hands them (``completion_ids`` is ``[]`` per
        row without them)."""
        if len(prompts) != len(completions):
            raise ValueError(f"reward {self.name!r}: got {len(prompts)} prompts and {len(completions)} "
                             "completions")
        contents = [list(p.content) if isinstance(p.content, tuple) else p.content for p in prompts]
        self._metrics = {}
        try:
            extra = {} if episodes is None else {"conversations": [list(e.messages) for e in episodes],
                                                 "environments": [e.environment for e in episodes],
                                                 "episode_ends": [e.end for e in episodes]}
            result = self.fn(
                prompts=contents, completions=self._completions(prompts, completions, episodes),
                completion_ids=[list(i) for i in completion_ids] if completion_ids is not None else
                [[] for _ in completions], trainer_state=trainer_state, log_metric=self._log_metric,
                log_extra=_log_extra, **columns(prompts), **extra)
            scores = list(_awaited(result) if inspect.isawaitable(result) else result)
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
            if isinstance(value, bool) or type(value).__name__ == "bool_":  # True / numpy.True_: 1.0
                value = float(value)
            if value is not None and (not isinstance(value, numbers.Real) or not math.isfinite(value)):
                raise RewardError(f"reward {self.name!r} returned {value!r} for sample {i} (completion="
                                  f"{excerpt(completions[i])}); return a finite number, or None when it does "
                                  "not apply")
            out.append(math.nan if value is None else float(value))
        return torch.tensor(out, dtype=torch.float32)

    def _completions(self, prompts: Sequence[Prompt], texts: Sequence[str],
                     episodes: Sequence[Episode] | None) -> list[Any]:
        """The completions as the function takes them: text, or messages (TRL's rule, or the setting)."""
        chat = self.conversational
        if chat is None:
            chat = bool(prompts) and all(isinstance(p.content, tuple) for p in prompts)
        if not chat:
            return list(texts)
        if episodes is not None:
            return [[dict(m) for m in e.messages] for e in episodes]
        return [[{"role": "assistant", "content": text}] for text in texts]

    def _log_metric(self, name: str, value: float) -> None:
        """TRL's ``log_metric``: one number for this batch's log (several calls: their mean)."""
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not (isinstance(name, str) and name and number):
            raise ValueError(f"log_metric({name!r}, {value!r}): give a metric name and a number")
        self._metrics.setdefault(name, []).append(float(value))

    def batch_metrics(self) -> dict[str, float]:
        """What the function logged with ``log_metric`` on the batch just scored (the mean of each)."""
        return {name: sum(v) / len(v) for name, v in self._metrics.items()}


def _log_extra(column: str, values: Sequence[Any]) -> None:
    """TRL's ``log_extra`` (a column of its completions table): accepted; there is no table to add to."""


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


def _awaited(awaitable: Any) -> Any:
    """The value of an ``async def`` reward's result, run to completion on a fresh event loop."""
    async def wait() -> Any:
        return await awaitable

    return asyncio.run(wait())
