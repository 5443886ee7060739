"""The subclassable reward: implement ``score`` for one completion, get a ``RewardFn``.

A :class:`Reward` satisfies the ``RewardFn`` protocol of ``protocols.py``: called on N prompts
and N completions (``prompts[i]`` is the prompt of ``completions[i]``), it returns a float32
tensor of shape [N]. Every score is checked: a score that raises, or that is not a finite real
number, becomes a :class:`RewardError` naming the reward, the sample index, and excerpts of the
question and of the completion. Nothing is silently turned into 0.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from grpo_engine.types import Prompt

__all__ = ["Reward", "RewardError", "check_weight", "check_scores"]

_EXCERPT_CHARS = 60


class RewardError(RuntimeError):
    """A reward failed on one sample (it raised, or returned a non-finite or non-numeric score)."""


def snake_case(name: str) -> str:
    """``MathAccuracy`` -> ``math_accuracy``, ``HTTPLength`` -> ``http_length``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def excerpt(text: Any, limit: int = _EXCERPT_CHARS) -> str:
    """A short ``repr`` of ``text`` for error messages, cut to ``limit`` characters."""
    text = str(text)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return repr(text)


def check_weight(weight: Any, owner: str) -> float:
    """``weight`` as a float, or ValueError naming ``owner``: a reward's weight is a finite real number."""
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
        raise ValueError(
            f"{owner}: weight={weight!r} must be a finite real number; "
            "pass for example weight=1.0 (or 0.0 to log a reward without training on it)"
        )
    return float(weight)


def check_scores(name: str, scores: Tensor, prompts: Sequence[Prompt], completions: Sequence[str], *,
                 allows_none: bool = False) -> Tensor:
    """``scores`` [N] when every one is finite (NaN allowed, meaning "does not apply", when
    ``allows_none``); else RewardError naming the reward, the samples and the first one's excerpts."""
    finite = torch.isfinite(scores)
    if allows_none:
        finite |= torch.isnan(scores)
    bad = torch.nonzero(~finite).flatten().tolist()
    if bad:
        first = bad[0]
        raise RewardError(
            f"reward {name!r} returned {scores[first].item()!r} (float) on sample {first} (non-finite "
            f"scores at samples {bad[:8]}); a score must be a finite real number (return a float, e.g. 0.0); "
            f"question={excerpt(prompts[first].question)}, completion={excerpt(completions[first])}"
        )
    return scores


class Reward:
    """Base class of a reward: subclass it and implement :meth:`score`.

    Args:
        weight: multiplier of this reward in :class:`~grpo_engine.rewards.WeightedSum`.
        name: key of this reward in logs and in ``RewardOutput.breakdown``; defaults to the
            snake_case class name (``MathAccuracy`` -> ``"math_accuracy"``).

    Example:
        >>> class Short(Reward):
        ...     def score(self, prompt, completion):
        ...         return 1.0 if len(completion) <= 5 else 0.0
        >>> Short(weight=0.5)([Prompt("q"), Prompt("q")], ["ok", "far too long"])
        tensor([1., 0.])
        >>> Short().name
        'short'
    """

    name: str = "reward"
    weight: float = 1.0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = snake_case(cls.__name__)

    def __init__(self, weight: float = 1.0, name: str | None = None) -> None:
        cls_name = type(self).__name__
        self.weight = check_weight(weight, cls_name)
        if name is None:
            name = type(self).name
        if not isinstance(name, str) or not name.strip():
            raise ValueError(
                f"{cls_name}: name={name!r} must be a non-empty string, e.g. name='my_reward'"
            )
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, weight={self.weight!r})"

    def score(self, prompt: Prompt, completion: str) -> float:
        """Scores one completion of ``prompt``. Subclasses implement this.

        Args:
            prompt: the prompt, with its ``target`` and ``metadata``.
            completion: the decoded completion text.

        Returns:
            A finite real number (higher is better).
        """
        raise NotImplementedError(
            f"{type(self).__name__} must implement score(self, prompt, completion) -> float "
            "(or score_batch(self, prompts, completions) -> list[float])"
        )

    def check(self, prompt: Prompt) -> str | None:
        """Why this reward cannot score ``prompt`` (e.g. its target is missing), or None; the trainer
        checks every training prompt when it is built. Override it for a reward with requirements."""
        return None

    def score_batch(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float]:
        """Scores N completions; override for vectorised scoring (a model-based judge...).

        The default calls :meth:`score` on each pair. ``__call__`` validates whatever this
        returns (length N, finite real numbers).

        Args:
            prompts: N prompts, ``prompts[i]`` is the prompt of ``completions[i]``.
            completions: N completion texts.

        Returns:
            N scores.
        """
        return [self.score(p, c) for p, c in zip(prompts, completions, strict=True)]

    def __call__(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> Tensor:
        """Scores N completions (the ``RewardFn`` protocol).

        Args:
            prompts: N prompts, one per completion.
            completions: N completion texts.

        Returns:
            [N] float32 scores.

        Raises:
            ValueError: the two sequences have different lengths.
            RewardError: scoring raised, or a score is not a finite real number.
        """
        if len(prompts) != len(completions):
            raise ValueError(
                f"reward {self.name!r}: got {len(prompts)} prompts and {len(completions)} completions; "
                "pass one prompt per completion (RolloutBatch.row_prompts repeats each prompt G times)"
            )
        if type(self).score_batch is Reward.score_batch:
            pairs = enumerate(zip(prompts, completions, strict=True))
            scores = [self._score_one(i, p, c) for i, (p, c) in pairs]
        else:
            scores = self._score_overridden_batch(prompts, completions)
        for i, value in enumerate(scores):
            self._check_value(i, value, prompts[i], completions[i])
        return check_scores(self.name, torch.tensor([float(v) for v in scores], dtype=torch.float32), prompts,
                            completions)

    def _score_one(self, index: int, prompt: Prompt, completion: str) -> Any:
        try:
            return self.score(prompt, completion)
        except Exception as exc:
            raise RewardError(
                f"reward {self.name!r} ({type(self).__name__}.score) raised {type(exc).__name__} "
                f"on sample {index}: {exc}; question={excerpt(prompt.question)}, "
                f"completion={excerpt(completion)}"
            ) from exc

    def _score_overridden_batch(
        self, prompts: Sequence[Prompt], completions: Sequence[str]
    ) -> list[Any]:
        try:
            scores = list(self.score_batch(prompts, completions))
        except RewardError:
            raise  # already names the reward and the sample
        except Exception as exc:
            raise RewardError(
                f"reward {self.name!r} ({type(self).__name__}.score_batch) raised "
                f"{type(exc).__name__} on a batch of {len(completions)} samples: {exc}"
            ) from exc
        if len(scores) != len(completions):
            raise RewardError(
                f"reward {self.name!r}: score_batch returned {len(scores)} scores for "
                f"{len(completions)} completions; return exactly one score per completion"
            )
        return scores

    def _check_value(self, index: int, value: Any, prompt: Prompt, completion: str) -> None:
        if not isinstance(value, numbers.Real):
            raise RewardError(
                f"reward {self.name!r} returned {value!r} ({type(value).__name__}) on sample {index}; "
                f"a score must be a finite real number (return a float, e.g. 0.0); "
                f"question={excerpt(prompt.question)}, completion={excerpt(completion)}"
            )
