"""Samplers: draw a group of completions per prompt (our decoding loop, an exact categorical draw,
LoRA merged while sampling); DAPO's dynamic sampling; the settings a sampler shares with the run's
config (:func:`agreed_config`)."""

from grpo_engine.sampling.decode import sample_categorical
from grpo_engine.sampling.dynamic import DynamicSampling
from grpo_engine.sampling.hf import HFSampler, completion_mask_from_ids
from grpo_engine.sampling.merge import merged_lora
from grpo_engine.sampling.settings import agreed_config

__all__ = ["HFSampler", "completion_mask_from_ids", "DynamicSampling", "merged_lora", "sample_categorical",
           "agreed_config"]
