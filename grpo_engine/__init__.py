"""grpo_engine: a PyTorch-native GRPO engine for small reasoning models on one GPU (or a CPU).

The public surface::

    from grpo_engine import GRPOTrainer, GRPOConfig, MemoryPlan, LoRA, HeldOutEval
    from grpo_engine.rewards import MathAccuracy, ThinkAnswerFormat, Reward
    from grpo_engine.data import load_jsonl_prompts, load_gsm8k, arithmetic_task
    from grpo_engine.tools import ToolSampler, python_tool   # multi-turn rollouts with tools
"""

import grpo_engine._quiet  # noqa: F401  (known third-party log noise, filtered where it arises)
import grpo_engine.trl.refused  # noqa: F401  (TRL's field names, in GRPOConfig's unknown-field errors)
from grpo_engine.advantages import RLOO, GroupNormalized, MeanBaseline, ReinforcePlusPlusBaseline
from grpo_engine.callbacks import Callback, HeldOutEval, TrainerControl, TrainerState
from grpo_engine.config import ConfigError, GRPOConfig
from grpo_engine.losses import ClippedSurrogate
from grpo_engine.memory import LoRA, MemoryPlan
from grpo_engine.protocols import (
    AdvantageFn,
    EntropyEstimator,
    GroupFilter,
    GRPOLoss,
    LossTerm,
    PromptSource,
    RewardFn,
    RewardTransform,
    RowFilter,
    Sampler,
)
from grpo_engine.report import TensorBoardLogger, TrackioLogger, WandbLogger
from grpo_engine.rewards import FunctionReward, Reward, WeightedSum
from grpo_engine.sampling import HFSampler
from grpo_engine.tools import ToolSampler
from grpo_engine.trainer import GRPOTrainer
from grpo_engine.types import LossOutput, MicroBatch, Prompt, Requirements, RewardOutput, RolloutBatch

__version__ = "0.1.0"

__all__ = [
    "GRPOTrainer",
    "GRPOConfig",
    "ConfigError",
    "MemoryPlan",
    "LoRA",
    "Prompt",
    "RolloutBatch",
    "RewardOutput",
    "MicroBatch",
    "LossOutput",
    "Requirements",
    "Callback",
    "HeldOutEval",
    "TrainerState",
    "TrainerControl",
    "Sampler",
    "GroupFilter",
    "LossTerm",
    "RowFilter",
    "PromptSource",
    "RewardTransform",
    "RewardFn",
    "EntropyEstimator",
    "AdvantageFn",
    "GRPOLoss",
    "HFSampler",
    "ToolSampler",
    "Reward",
    "FunctionReward",
    "WeightedSum",
    "TensorBoardLogger",
    "WandbLogger",
    "TrackioLogger",
    "GroupNormalized",
    "MeanBaseline",
    "RLOO",
    "ReinforcePlusPlusBaseline",
    "ClippedSurrogate",
]
