"""Weighted sum of rewards, ``total[b, g] = Σ_k weight_k · s_k[b, g]``, and the step's reward transforms.

Each reward scores the N = B * G completions of a :class:`RolloutBatch` once: through
``reward.score_rollout(batch) -> [N]`` when it defines it (rewards on tokens, such as
:class:`~grpo_engine.rewards.OverlongPenalty`), else ``reward(batch.row_prompts, batch.texts) -> [N]``.
Its raw [B, G] scores go into ``RewardOutput.breakdown`` under its ``name``. ``normalize`` sets s_k:

* ``"after_sum"`` (default): the raw score; the advantage function alone normalises the total.
* ``"each"``: the score group-z-scored on its own, (x - mean_g x) / (std_g x + 1e-6), unbiased std over
  the G completions, exactly 0 in a group where that reward is equal (GDPO, arXiv 2601.05242). Pair it
  with ``ReinforcePlusPlusBaseline()`` (whitens the sum over the batch) or ``MeanBaseline()`` (keeps it);
  the default ``GroupNormalized()`` would z-score the sum once more per group.

A reward with weight 0 is logged but does not train. A ``RewardTransform`` in the list (``KLRewardPenalty``)
is kept apart: :meth:`WeightedSum.transform` applies it once the log-probs :attr:`requires` names are known.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Sequence
from typing import Literal, get_args

import torch
from torch import Tensor

from grpo_engine.ops.groups import group_zscore
from grpo_engine.protocols import RewardFn, RewardTransform
from grpo_engine.rewards.base import RewardError
from grpo_engine.rewards.function import FunctionReward
from grpo_engine.types import Prompt, Requirements, RewardOutput, RolloutBatch

__all__ = ["WeightedSum", "RewardTimeout"]


class RewardTimeout(RewardError):
    """A reward did not return within the per-batch timeout."""


def _as_reward(reward: object) -> object:
    """A plain function (no ``name`` / ``weight``) wrapped as a :class:`FunctionReward`."""
    if callable(reward) and not hasattr(reward, "weight") and not hasattr(reward, "score_rollout"):
        return FunctionReward(reward)
    return reward


def _within(run, timeout_s: float | None, name: str, n: int):
    """``run()``, in a worker thread when ``timeout_s`` is set; raises :class:`RewardTimeout` after it
    (the thread cannot be stopped: it finishes, or not, in the background)."""
    if timeout_s is None:
        return run()
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = run()
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"reward-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RewardTimeout(f"reward {name!r} did not return within {timeout_s:g} s on a batch of {n} completions "
                            "(it keeps running in the background); make it faster, raise "
                            "GRPOConfig.reward_timeout_s, or set on_reward_error='zero' to score such batches 0")
    if "error" in box:
        error = box["error"]
        if isinstance(error, RewardError):
            raise error
        raise RewardError(f"reward {name!r} raised {type(error).__name__}: {error}") from error
    return box["value"]

Normalize = Literal["after_sum", "each"]



class WeightedSum:
    """Combines rewards into the ``RewardOutput`` of a step.

    Args:
        rewards: one or more ``RewardFn`` (e.g. :class:`~grpo_engine.rewards.Reward`
            subclasses), each with a unique ``name`` and a finite ``weight``. A reward may
            define ``score_rollout(batch) -> Tensor [N]`` instead of (or besides) being called on
            texts; that method is then the one used.
        normalize: ``"after_sum"`` sums the raw scores; ``"each"`` group-z-scores each reward's
            scores before the weighted sum (see the module docstring).

    Example:
        >>> from grpo_engine.rewards import MathAccuracy, OverlongPenalty, ThinkAnswerFormat
        >>> combo = WeightedSum([MathAccuracy(), ThinkAnswerFormat(weight=0.1),
        ...                      OverlongPenalty(max_completion_tokens=1024, cache_tokens=256)])
        >>> combo.names
        ('math_accuracy', 'think_answer_format', 'overlong_penalty')
    """

    def __init__(self, rewards: Sequence[RewardFn | RewardTransform], *, normalize: Normalize = "after_sum",
                 timeout_s: float | None = None, on_error: Literal["raise", "zero"] = "raise") -> None:
        self.transforms: tuple[RewardTransform, ...] = tuple(r for r in rewards if isinstance(r, RewardTransform))
        rewards = tuple(_as_reward(r) for r in rewards if not isinstance(r, RewardTransform))
        if not rewards:
            raise ValueError(
                "WeightedSum needs at least one reward; pass e.g. WeightedSum([MathAccuracy()])"
            )
        if normalize not in get_args(Normalize):
            raise ValueError(
                f"WeightedSum: normalize={normalize!r} must be 'after_sum' (weighted sum of raw scores) or "
                "'each' (group-z-score each reward, then sum); for example WeightedSum(rewards, normalize='each')"
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
            if (
                isinstance(weight, bool)
                or not isinstance(weight, numbers.Real)
                or not math.isfinite(weight)
            ):
                raise ValueError(
                    f"WeightedSum: reward {name!r} has weight={weight!r}; "
                    "a weight must be a finite real number, e.g. 1.0"
                )
            if name in seen:
                raise ValueError(
                    f"WeightedSum: two rewards are named {name!r} ({seen[name]!r} and {reward!r}); "
                    f"names key the logged breakdown, so give each a unique one, "
                    f"e.g. {type(reward).__name__}(name='{name}_2')"
                )
            seen[name] = reward
        self.rewards: tuple[RewardFn, ...] = rewards
        self.normalize: Normalize = normalize
        if on_error not in ("raise", "zero"):
            raise ValueError(f"WeightedSum: on_error={on_error!r} must be 'raise' (stop the run) or 'zero' (score a "
                             "failing sample 0 and count it in reward/<name>/errors)")
        self.timeout_s, self.on_error = timeout_s, on_error

    def configured(self, *, timeout_s: float | None, on_error: str) -> WeightedSum:
        """The same rewards and transforms with another timeout and error policy."""
        return WeightedSum([*self.rewards, *self.transforms], normalize=self.normalize, timeout_s=timeout_s,
                           on_error=on_error)

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
        return f"WeightedSum({list(self.rewards) + list(self.transforms)!r}{extra})"

    @property
    def requires(self) -> Requirements:
        """The log-probs the transforms need (old, reference) before :meth:`transform`."""
        return Requirements(old_logprobs=any(t.requires.old_logprobs for t in self.transforms),
                            ref_logprobs=any(t.requires.ref_logprobs for t in self.transforms))

    def transform(self, rewards: RewardOutput, batch: RolloutBatch, *, old_logprobs: Tensor | None = None,
                  ref_logprobs: Tensor | None = None) -> RewardOutput:
        """The rewards after each transform, in order ([N, C] log-probs as :attr:`requires` asks)."""
        for t in self.transforms:
            rewards = t.transform(rewards, batch, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs)
        return rewards

    def __call__(self, batch: RolloutBatch) -> RewardOutput:
        """Scores a batch.

        Args:
            batch: N = B * G completions with their prompts.

        Returns:
            ``total`` [B, G] float32, the weighted sum (of raw or of group-z-scored scores, per
            ``normalize``); ``breakdown`` name -> [B, G] float32 raw unweighted scores.

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
        total = torch.zeros(b, g, dtype=torch.float32)
        breakdown: dict[str, Tensor] = {}
        errors: dict[str, int] = {}
        for reward in self.rewards:
            scores, errors[reward.name] = self._scores(reward, batch)
            scores = scores.to(device=total.device, dtype=torch.float32).view(b, g)
            breakdown[reward.name] = scores
            if self.normalize == "each":
                if scores.isnan().any():
                    raise RewardError(f"reward {reward.name!r} returned None for some samples, which normalize='each' "
                                      "cannot z-score; use normalize='after_sum'")
                scores = group_zscore(scores, 1e-6, "WeightedSum")
            total = total + float(reward.weight) * scores.nan_to_num(nan=0.0)  # None: left out of the sum
        return RewardOutput(total=total, breakdown=breakdown, errors=errors)

    def _scores(self, reward: RewardFn, batch: RolloutBatch) -> tuple[Tensor, int]:
        """[N] checked scores of one reward and how many samples failed (``on_error="zero"``: scored 0)."""
        n = batch.num_completions
        score_rollout = getattr(reward, "score_rollout", None)
        run = (lambda: score_rollout(batch)) if callable(score_rollout) else (
            lambda: reward(batch.row_prompts, batch.texts))
        try:
            return self._checked(reward, _within(run, self.timeout_s, reward.name, n), n), 0
        except RewardError as error:
            if self.on_error == "raise":
                raise
            if isinstance(error, RewardTimeout) or callable(score_rollout):
                return torch.zeros(n), n  # nothing to keep: the whole batch scores 0
        scores, failed = torch.zeros(n), 0  # one failing sample: score the others one by one
        for i in range(n):
            try:
                one = _within(lambda i=i: reward([batch.row_prompts[i]], [batch.texts[i]]), self.timeout_s,
                              reward.name, 1)
                scores[i] = self._checked(reward, one, 1)[0]
            except RewardError:
                failed += 1
        return scores, failed

    @staticmethod
    def _checked(reward: RewardFn, scores: object, n: int) -> Tensor:
        name = reward.name
        if not isinstance(scores, Tensor):
            raise RewardError(
                f"reward {name!r} returned {type(scores).__name__}; a RewardFn must return a "
                f"float tensor of shape [N]=[{n}] (torch.tensor(scores, dtype=torch.float32))"
            )
        if tuple(scores.shape) != (n,):
            raise RewardError(
                f"reward {name!r} returned shape {tuple(scores.shape)}; expected [N]=[{n}], "
                "one score per completion (flatten it, and score batch.row_prompts/batch.texts)"
            )
        if not scores.is_floating_point():
            raise RewardError(
                f"reward {name!r} returned dtype {scores.dtype}; expected a floating dtype "
                "(torch.float32); convert with .float()"
            )
        finite = torch.isfinite(scores)
        if getattr(reward, "allows_none", False):
            finite |= torch.isnan(scores)  # None: the reward does not apply to that sample
        bad = torch.nonzero(~finite).flatten()
        if bad.numel():
            raise RewardError(
                f"reward {name!r} returned non-finite scores at samples {bad[:8].tolist()} "
                f"(values {scores[bad[:8]].tolist()}); a reward must return finite numbers"
            )
        return scores
