"""Rewards: subclass :class:`Reward` (one ``score`` method), combine with :class:`WeightedSum`.

Built-in: :class:`MathAccuracy` (math-verify), :class:`ThinkAnswerFormat`, :class:`BoxedFormat`,
:class:`OverlongPenalty` (DAPO soft overlong punishment, on token lengths); the reward transform
:class:`KLRewardPenalty` (a KL penalty in the reward instead of the loss); :class:`CodeTests` (a completion's
code against its task's tests, in the sandbox). A plain function
``fn(prompts, completions, **columns) -> list[float | None]`` is a reward too (:class:`FunctionReward`).
"""

from grpo_engine.rewards.base import Reward, RewardError
from grpo_engine.rewards.code import CodeTests
from grpo_engine.rewards.compose import WeightedSum
from grpo_engine.rewards.format import BoxedFormat, ThinkAnswerFormat
from grpo_engine.rewards.function import FunctionReward
from grpo_engine.rewards.kl_penalty import KLRewardPenalty
from grpo_engine.rewards.length import FinishedOnly, OverlongPenalty
from grpo_engine.rewards.math import MathAccuracy, answers_equal, extract_answer, final_answer, last_number
from grpo_engine.rewards.runner import RewardRunner, RewardTimeout, trainer_runner

__all__ = [
    "BoxedFormat",
    "CodeTests",
    "FinishedOnly",
    "FunctionReward",
    "KLRewardPenalty",
    "MathAccuracy",
    "OverlongPenalty",
    "Reward",
    "RewardError",
    "RewardRunner",
    "RewardTimeout",
    "ThinkAnswerFormat",
    "WeightedSum",
    "answers_equal",
    "extract_answer",
    "final_answer",
    "last_number",
    "trainer_runner",
]
