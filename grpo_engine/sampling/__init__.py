"""Samplers: draw a group of completions per prompt; DAPO's dynamic sampling."""

from grpo_engine.sampling.dynamic import DynamicSampling, concat_rollouts, select_groups
from grpo_engine.sampling.hf import HFSampler, completion_mask_from_ids

__all__ = ["HFSampler", "completion_mask_from_ids", "DynamicSampling", "concat_rollouts", "select_groups"]
