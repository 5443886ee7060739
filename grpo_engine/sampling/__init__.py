"""Samplers: draw a group of completions per prompt (our decoding loop, an exact categorical draw,
LoRA merged while sampling); DAPO's dynamic sampling."""

from grpo_engine.sampling.decode import sample_categorical
from grpo_engine.sampling.dynamic import DynamicSampling
from grpo_engine.sampling.hf import HFSampler, completion_mask_from_ids
from grpo_engine.sampling.merge import merged_lora

__all__ = ["HFSampler", "completion_mask_from_ids", "DynamicSampling", "merged_lora", "sample_categorical"]
