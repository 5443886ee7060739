"""Memory plans: LoRA, gradient checkpointing, optimizer choice, micro-batching, precision."""

from grpo_engine.memory.apply import build_optimizer, prepare_model
from grpo_engine.memory.plan import LoRA, MemoryPlan

__all__ = ["LoRA", "MemoryPlan", "prepare_model", "build_optimizer"]
