"""Memory plans: LoRA / QLoRA, gradient checkpointing and offload, optimizers, micro-batching,
precision, prompt sharing; and the estimator that predicts the peak and picks a plan for a budget."""

from grpo_engine.memory.apply import build_optimizer, prepare_model
from grpo_engine.memory.budget import PlanChoice, auto_plan, plan_for_budget
from grpo_engine.memory.estimate import KNOWN_SHAPES, ModelShape, Workload, estimate_memory
from grpo_engine.memory.plan import LoRA, MemoryPlan

__all__ = ["LoRA", "MemoryPlan", "prepare_model", "build_optimizer", "Workload", "ModelShape", "KNOWN_SHAPES",
           "estimate_memory", "plan_for_budget", "auto_plan", "PlanChoice"]
