"""Weighted sum of rewards, ``total[b, g] = Σ_k weight_k · s_k[b, g]``, and the step's reward transforms.

Each reward scores the N = B * G completions of a :class:`RolloutBatch` once: through
``reward.score_rollout(batch) -> [N]`` when it defines it (rewards on tokens, such as
:class:`~grpo_engine.rewards.OverlongPenalty`), else ``reward(batch.row_prompts, batch.texts) -> [N]``.
Its raw [B, G] scores go into ``RewardOutput.breakdown`` under its ``name``. ``normalize`` sets s_k:

* ``"after_sum"`` (default): the raw score; the advantage function alone normalises the total.
* ``"each"``: the score group-z-scored on its own, (x - mean_g x) / (std_g x + eps), unbiased std over
  the G completions, exactly 0 in a group where that reward is equal (GDPO, arXiv 2601.05242). Pair it
  with ``ReinforcePlusPlusBaseline()`` (whitens the sum over the batch: GDPO, and with ``eps=1e-4`` on
  both exactly TRL's ``multi_objective_aggregation="normalize_then_sum"``; ``presets.gdpo()``) or
  ``MeanBaseline()`` (keeps it); the default ``GroupNormalized()`` would z-score the sum once more.

A reward with weight 0 is logged but does not train. A ``RewardTransform`` in the list (``KLRewardPenalty``)
is kept apart: :meth:`WeightedSum.transform` applies it once the log-probs :attr:`requires` names are known.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import torch
from torch import Tensor

from grpo_engine.ops.groups import check_eps, group_zscore
from grpo_engine.protocols import RewardFn, RewardTransform
from grpo_engine.rewards.base import RewardError, check_weight
from grpo_engine.rewards.function import FunctionReward
from grpo_engine.rewards.runner import RewardRunner, RewardTimeout
from grpo_engine.types import Prompt, Requirements, RewardOutput, RolloutBatch

__all__ = ["WeightedSum", "RewardTimeout", "RewardRunner"]


Normalize = Literal["after_sum", "each"]


def _as_reward(reward: object) -> object:
    """A plain function (no ``name`` / ``weight``) wrapped as a :class:`FunctionReward`."""
    if callable(reward) and not hasattr(reward, "weight") and not hasattr(reward, "score_rollout"):
        return FunctionReward(reward)
    return reward


class WeightedSum:
    """Combines rewards into the ``RewardOutput`` of a step.

    Args:
        rewards: one or more ``RewardFn`` (e.g. :class:`~grpo_engine.rewards.Reward`
            subclasses), each with a unique ``name`` and a finite ``weight``. A reward may
            define ``score_rollout(batch) -> Tensor [N]`` instead of (or besides) being called on
            texts; that method is then the one used.
        normalize: ``"after_sum"`` sums the raw scores; ``"each"`` group-z-scores each reward's
            scores before the weighted sum (see the module docstring).
        eps: >= 0, added to each reward's group std under ``normalize="each"`` (TRL: 1e-4).
        timeout_s, on_error: how this combination runs its rewards (a :class:`RewardRunner`); unset,
            the trainer's ``GRPOConfig.reward_timeout_s`` and ``on_reward_error`` apply (setting both,
            differently, is refused), and a call outside a trainer runs without a limit and raises.

    Example:
        >>> from grpo_engine.rewards import MathAccuracy, OverlongPenalty, ThinkAnswerFormat
        >>> combo = WeightedSum([MathAccuracy(), ThinkAnswerFormat(weight=0.1),
        ...                      OverlongPenalty(max_completion_tokens=1024, cache_tokens=256)])
        >>> combo.names
        ('math_accuracy', 'think_answer_format', 'overlong_penalty')
    """

    def __init__(self, rewards: Sequence[RewardFn | RewardTransform], *, normalize: Normalize = "after_sum",
                 timeout_s: float | None = None, on_error: Literal["raise", "zero"] | None = None,
                 eps: float = 1e-6) -> None:
        check_eps(eps, "WeightedSum")
        self.transforms: tuple[RewardTransform, ...] = tuple(
            r for r in rewards if isinstance(r, RewardTransform))
        rewards = tuple(_as_reward(r) for r in rewards if not isinstance(r, RewardTransform))
        if not rewards:
            raise ValueError(
                "WeightedSum needs at least one reward; pass e.g. WeightedSum([MathAccuracy()])"
            )
        if normalize not in get_args(Normalize):
            raise ValueError(
                f"WeightedSum: normalize={normalize!r} must be 'after_sum' (weighted sum of raw scores) or "
                "'each' (group-z-score each reward, then sum); for example "
                "WeightedSum(rewards, normalize='each')"
            )
        seen: dict[str, RewardFn] = {}
        for reward in rewards:
            name = getattr(reward, "name", None)
            weight = getattr(reward, "weight", None)
            scorable = callable(reward) or callable(getattr(reward, "score_rollout", None))
            if not isinstance(name, str) or not name or not scorable:
                raise TypeError(
                    f"WeightedSum: {reward!r} is not a RewardFn (a callable with a non-empty str "
                    "`name` and a float `weight`); subclass grpo_engine.rewards.Reward"
                )
            check_weight(weight, f"WeightedSum: reward {name!r}")
            if name in seen:
                raise ValueError(
                    f"WeightedSum: two rewards are named {name!r} ({seen[name]!r} and {reward!r}); "
                    f"names key the logged breakdown, so give each a unique one, "
                    f"e.g. {type(reward).__name__}(name='{name}_2')"
                )
            seen[name] = reward
        self.rewards: tuple[RewardFn, ...] = rewards
        self.normalize: Normalize = normalize
        self.eps = eps
        self.runner = (None if timeout_s is None and on_error is None
                       else RewardRunner(timeout_s, on_error or "raise"))

    def check(self, prompts: Sequence[Prompt]) -> list[str]:
        """Every problem the rewards find with the prompts' targets (``Reward.check``), one line each,
        with the record's file and line where the prompt has them."""
        problems = []
        for reward in self.rewards:
            check = getattr(reward, "check", None)
            for prompt in prompts if callable(check) else ():
                problem = check(prompt)
                if problem:
                    problems.append(f"{prompt.location}: {reward.name}: {problem}")
        return problems

    @property
    def names(self) -> tuple[str, ...]:
        """The reward names, in order (the keys of ``RewardOutput.breakdown``)."""
        return tuple(r.name for r in self.rewards)

    def __repr__(self) -> str:
        extra = "" if self.normalize == "after_sum" else f", normalize={self.normalize!r}"
        extra += "" if self.eps == 1e-6 else f", eps={self.eps!r}"
        return f"WeightedSum({list(self.rewards) + list(self.transforms)!r}{extra})"

    @property
    def requires(self) -> Requirements:
        """The log-probs the transforms need (old, reference) before :meth:`transform`."""
        return Requirements.union([t.requires for t in self.transforms])

    def transform(self, rewards: RewardOutput, batch: RolloutBatch, *, old_logprobs: Tensor | None = None,
                  ref_logprobs: Tensor | None = None) -> RewardOutput:
        """The rewards after each transform, in order ([N, C] log-probs as :attr:`requires` asks)."""
        for t in self.transforms:
            rewards = t.transform(rewards, batch, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs)
        return rewards

    def __call__(self, batch: RolloutBatch, runner: RewardRunner | None = None) -> RewardOutput:
        """Scores a batch.

        Args:
            batch: N = B * G completions with their prompts.
            runner: calls each reward (time limit, error policy); default: this combination's own
                (``timeout_s``, ``on_error``), else ``RewardRunner()`` (no limit, a failure raises).

        Returns:
            ``total`` [B, G] float32, the weighted sum (of raw or of group-z-scored scores, per
            ``normalize``); ``breakdown`` name -> [B, G] float32 raw unweighted scores; ``metrics`` the
            counts a reward with ``batch_metrics()`` reported for this batch (``reward/<name>/<key>``).

        Raises:
            RewardError: a reward returned something other than a finite floating [N] tensor
                (or a ``Reward`` failed on a sample).
            ValueError: ``normalize="each"`` with ``batch.group_size`` < 2.
        """
        b, g = batch.num_prompts, batch.group_size
        if self.normalize == "each" and g < 2:
            raise ValueError(
                f"WeightedSum(normalize='each'): group_size={g} makes every group-z-scored reward 0; "
                "use group_size >= 2, or normalize='after_sum'"
            )
        runner = runner or self.runner or RewardRunner()
        total = torch.zeros(b, g, dtype=torch.float32)
        breakdown: dict[str, Tensor] = {}
        errors: dict[str, int] = {}
        metrics: dict[str, float] = {}
        for reward in self.rewards:
            scores, errors[reward.name] = runner.scores(reward, batch)
            report = getattr(reward, "batch_metrics", None)  # counts of the batch just scored, if any
            counts = report() if callable(report) else {}
            metrics.update({f"reward/{reward.name}/{k}": float(v) for k, v in counts.items()})
            scores = scores.to(device=total.device, dtype=torch.float32).view(b, g)
            breakdown[reward.name] = scores
            if self.normalize == "each":
                if scores.isnan().any():
                    raise RewardError(f"reward {reward.name!r} returned None for some samples, which "
                                      "normalize='each' cannot z-score; use normalize='after_sum'")
                scores = group_zscore(scores, self.eps, "WeightedSum")
            total = total + float(reward.weight) * scores.nan_to_num(nan=0.0)  # None: left out of the sum
        return RewardOutput(total=total, breakdown=breakdown, errors=errors, metrics=metrics)
