"""Samplers: draw a group of completions per prompt."""

from grpo_engine.sampling.hf import HFSampler, completion_mask_from_ids

__all__ = ["HFSampler", "completion_mask_from_ids"]
