"""MemoryPlan: how the model is held and trained, applied once before the loop starts.

A frozen record that ``grpo_engine.memory.apply`` turns into a prepared model and an optimizer. Fields:
``lora`` (peft adapters; the reference policy is then the model with its adapters disabled, no copy),
``quantization="nf4"`` (QLoRA: a 4-bit NF4 base, double quantisation, compute in ``dtype``, fp32 adapters),
``gradient_checkpointing``, ``offload_activations`` (saved tensors in pinned CPU memory), ``optimizer``
(``adamw``, bitsandbytes ``adamw8bit``, or ``paged_adamw`` / ``paged_adamw8bit`` in unified memory),
``share_prompt`` (a group's prompt runs once: in sampling, and in training unless checkpointed),
``merge_lora_for_sampling`` (a temporary merged copy of the adapted float32 weights while sampling),
``pack_weights_for_sampling`` (CPU: the large float32 linear weights packed for oneDNN while sampling),
``compiled_products_for_sampling`` (CPU, compiled decoding: the step's linear products in its own loops),
``decoding`` (``auto``: ``cuda_graph`` on a GPU, ``dynamic`` on the CPU; or ``dynamic``, ``static``,
``compiled``, ``cuda_graph``), ``compile_decoding`` (the CUDA graphs replay the compiled step, or the eager
one), ``compile_training`` (the training pass's decoder layers through ``torch.compile``),
``micro_batch_size`` (completions per forward/backward; the accumulated gradient equals the one-batch
gradient), ``dtype`` (base weights; adapters stay float32), ``compute_dtype`` (mixed precision: float32
weights, gradients and AdamW states, forward passes under ``torch.autocast``), ``logprob_chunk_size`` /
``logprob_vocab_tile`` (at most chunk x tile logits; ``auto``: chosen per device, small on a CPU, the fewest
passes that fit on a GPU), ``sharding`` (under torchrun: ``none``, or ``fsdp``: FSDP2 over the ranks,
docs/distributed.md).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from grpo_engine.config import FrozenModel

__all__ = ["LoRA", "MemoryPlan"]


class LoRA(FrozenModel):
    """LoRA adapter settings (peft).

    Example:
        >>> LoRA(r=16, alpha=32).target_modules
        'all-linear'
    """

    r: int = Field(16, description="Adapter rank.")
    alpha: float = Field(
        None, description="Scaling numerator: the update is (alpha / r) * B @ A (default 2 * r)."
    )
    dropout: float = Field(0.0, description="Dropout on the adapter input (0 keeps log-probs exact).")
    target_modules: str | list[str] = Field(
        "all-linear", description="Module names to adapt, or 'all-linear' "
        "(every linear layer but the lm_head)."
    )


    @model_validator(mode="before")
    @classmethod
    def _default_alpha(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("alpha") is None and isinstance(data.get("r", 16), int):
            data = {**data, "alpha": 2.0 * data.get("r", 16)}  # one default everywhere: alpha = 2 r
        return data

    @classmethod
    def from_peft(cls, config: Any) -> LoRA:
        """The LoRA of a peft ``LoraConfig`` (rank, alpha, dropout, target modules); a setting this
        plan cannot honour (DoRA, rsLoRA, per-layer ranks, biases, ...) is refused by name."""
        from peft import LoraConfig

        default = LoraConfig()
        ours = {"r", "lora_alpha", "lora_dropout", "target_modules", "task_type", "peft_type",
                "inference_mode", "base_model_name_or_path", "revision", "auto_mapping"}
        unsupported = {k: v for k, v in vars(config).items()
                       if k not in ours and not k.startswith("_") and v != getattr(default, k, v)}
        if config.bias not in (None, "none"):
            unsupported["bias"] = config.bias
        if unsupported:
            raise ValueError(f"LoraConfig settings {unsupported} are not supported by MemoryPlan's LoRA "
                             "(rank, alpha, dropout, target modules); drop them, or build the PeftModel "
                             "yourself and pass it as the model with MemoryPlan(lora=None): "
                             "it is then trained as it is")
        if config.target_modules is None:
            raise ValueError("LoraConfig(target_modules=None) leaves the choice to peft; name them, e.g. "
                             "target_modules='all-linear' or ['q_proj', 'v_proj']")
        modules = config.target_modules
        return cls(r=config.r, alpha=config.lora_alpha, dropout=config.lora_dropout,
                   target_modules=modules if isinstance(modules, str) else sorted(modules))


LoRA.field_rules = {
    "r": (lambda v: v >= 1, "must be >= 1", "use a rank such as 8, 16 or 64"),
    "alpha": (lambda v: v > 0, "must be > 0", "use alpha = 2 * r as a start"),
    "dropout": (lambda v: 0 <= v < 1, "must be in [0, 1)", "use 0.0"),
    "target_modules": (lambda v: bool(v), "must not be empty",
                       "use 'all-linear' or e.g. ['q_proj', 'v_proj']"),
}


class MemoryPlan(FrozenModel):
    """How the policy is held in memory and trained.

    Example:
        >>> plan = MemoryPlan(lora=LoRA(r=8), gradient_checkpointing=True, micro_batch_size=4)
        >>> plan.optimizer
        'adamw'
    """

    lora: LoRA | None = Field(None, description="LoRA adapter settings (a LoRA, or a peft LoraConfig); "
                              "null trains every weight, or the adapters of a PeftModel passed as the model.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in the backward pass.")
    quantization: Literal["nf4"] | None = Field(
        None, description="nf4: 4-bit NF4 frozen base under LoRA (QLoRA; needs lora). null: base in dtype."
    )
    optimizer: Literal["adamw", "adamw8bit", "paged_adamw", "paged_adamw8bit"] = Field(
        "adamw", description="adamw (torch), adamw8bit (bitsandbytes 8-bit states), or their paged variants."
    )
    offload_activations: bool = Field(
        False, description="Keep the activations saved for backward in (pinned) CPU memory."
    )
    share_prompt: bool = Field(
        True, description="Run each prompt once per group (sampling prefill "
        "and training forward), not G times."
    )
    merge_lora_for_sampling: bool = Field(
        False, description="Sample with the LoRA deltas merged into a temporary copy "
        "of the adapted weights: faster decoding for one copy of those weights while sampling "
        "(float32 base weights, no quantization)."
    )
    pack_weights_for_sampling: bool = Field(
        False, description="CPU only: sample with each large float32 linear weight in oneDNN's packed layout "
        "(grpo_engine.sampling.packed), the trained weights packed at every sampling call and a frozen LoRA "
        "base once per run: faster decoding steps for one packed copy of those weights (kept for the run "
        "under unmerged LoRA)."
    )
    compiled_products_for_sampling: bool = Field(
        False, description="CPU, decoding='compiled' only: the compiled decoding step computes each float32 "
        "linear layer's product in its own C++ loops, a multiply and a sum along each weight row, instead of "
        "calling BLAS (grpo_engine.sampling.compiled_products): faster for a small model with few rows; no "
        "memory."
    )
    decoding: Literal["auto", "dynamic", "static", "compiled", "cuda_graph"] = Field(
        "auto", description="Sampling's decoding path: auto (a CUDA graph over a static KV cache on a GPU, "
        "the dynamic loop that drops finished rows on the CPU), dynamic, static, "
        "compiled (torch.compile) or cuda_graph."
    )
    compile_decoding: bool = Field(
        True, description="On a GPU (decoding cuda_graph, the GPU's auto): the CUDA graphs replay the "
        "torch.compile'd decoding step (norm, RoPE, softmax and LoRA fused; it compiles at the first "
        "sampling calls, twice per run); false: they replay the eager step (no compile time, more kernels "
        "per token)."
    )
    compile_training: bool = Field(
        False, description="Run the decoder layers through torch.compile in the training pass (fused "
        "element-wise kernels; grpo_engine.compiling). Compiles at the first step; on the CPU it needs a "
        "C++ compiler."
    )
    micro_batch_size: int = Field(8, description="Completions per forward/backward (gradient accumulation).")
    sharding: Literal["none", "fsdp"] = Field(
        "none", description="Under torchrun: none (every rank holds the whole model: data parallel) "
        "or fsdp (FSDP2: each decoder layer and the embeddings sharded over the ranks, with their gradients "
        "and AdamW states; the whole model gathered while sampling; the lm_head replicated)."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Dtype of the (frozen) base weights; adapters stay float32."
    )
    compute_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="Mixed precision: the dtype forward passes compute in under torch.autocast, "
        "when it differs from dtype (e.g. float32 weights, bfloat16 compute). null: compute in dtype."
    )
    logprob_vocab_tile: int | Literal["auto"] | None = Field(
        "auto", description="Vocabulary entries per tile of the lm_head pass (plain linear heads); bounds "
        "the logits to chunk x tile floats in forward and backward. null: whole-vocabulary chunks (a "
        "soft-capped or adapted head's path). auto: chosen with logprob_chunk_size for the device (32,768 on "
        "the CPU; on a GPU the fewest tiles that fit, memory.estimate.logprob_granularity)."
    )
    logprob_chunk_size: int | Literal["auto"] = Field(
        "auto", description="Tokens per lm_head/log-softmax chunk; bounds the logits memory to chunk x vocab "
        "floats (256 x 151,936 x 4 B = 156 MB for a Qwen2.5 vocabulary). auto: chosen for the device (256 "
        "on the CPU; on a GPU the fewest chunks that fit, one per micro-batch where it fits)."
    )

    @field_validator("lora", mode="before")
    @classmethod
    def _peft_config(cls, value: Any) -> Any:
        """A peft ``LoraConfig`` is taken as the LoRA it describes (``LoRA.from_peft``)."""
        if type(value).__name__ == "LoraConfig" and type(value).__module__.startswith("peft"):
            return LoRA.from_peft(value)
        return value

    @model_validator(mode="after")
    def _check_combinations(self) -> MemoryPlan:
        if self.quantization is not None and self.lora is None:
            raise ValueError(f"quantization={self.quantization!r} needs lora: a 4-bit base cannot be trained "
                             "itself; add lora=LoRA(r=16) (QLoRA), or set quantization to null")
        if self.merge_lora_for_sampling and (self.lora is None or self.quantization is not None
                                             or self.dtype != "float32"):
            raise ValueError("merge_lora_for_sampling=True needs lora, dtype='float32' and no quantization "
                             f"(got lora={'set' if self.lora else None}, dtype={self.dtype!r}, "
                             f"quantization={self.quantization!r}): a merged 4-bit or half-precision weight "
                             "would lose small LoRA updates; set merge_lora_for_sampling=False")
        if self.pack_weights_for_sampling and (self.dtype != "float32" or self.sharding != "none"
                                               or self.compute_dtype not in (None, "float32")):
            raise ValueError(f"pack_weights_for_sampling=True with dtype={self.dtype!r}, compute_dtype="
                             f"{self.compute_dtype!r} and sharding={self.sharding!r}: packing is for float32 "
                             "weights computed in float32, unsharded; set pack_weights_for_sampling=False")
        if self.compiled_products_for_sampling and (
                self.decoding != "compiled" or self.pack_weights_for_sampling or self.dtype != "float32"
                or self.compute_dtype not in (None, "float32") or self.sharding != "none"):
            raise ValueError(f"compiled_products_for_sampling=True with decoding={self.decoding!r}, "
                             f"pack_weights_for_sampling={self.pack_weights_for_sampling}, "
                             f"dtype={self.dtype!r}, compute_dtype={self.compute_dtype!r} and "
                             f"sharding={self.sharding!r}: it changes the compiled decoding step of float32 "
                             "weights computed in float32, unsharded, unpacked; set decoding='compiled' and "
                             "pack_weights_for_sampling=False, or compiled_products_for_sampling=False")
        if self.compile_training and (self.quantization is not None or self.sharding != "none"):
            raise ValueError(f"compile_training=True with quantization={self.quantization!r} and "
                             f"sharding={self.sharding!r}: compiling the training pass is not supported with "
                             "a 4-bit base or FSDP2 sharding yet; set compile_training=False")
        mixed = self.compute_dtype not in (None, self.dtype)
        if mixed and (self.dtype != "float32" or self.quantization is not None):
            raise ValueError(f"compute_dtype={self.compute_dtype!r} with dtype={self.dtype!r} "
                             f"and quantization={self.quantization!r}: mixed precision keeps float32 "
                             "weights and computes in a half type; use dtype='float32' without quantization, "
                             "or set compute_dtype to null")
        return self

    @property
    def mixed_precision(self) -> bool:
        """Whether forward passes run under autocast in ``compute_dtype`` (it differs from ``dtype``)."""
        return self.compute_dtype not in (None, self.dtype)


MemoryPlan.field_rules = {
    "logprob_vocab_tile": (lambda v: v is None or v == "auto" or v >= 1, "must be >= 1",
                           "use e.g. 32768, 'auto', or null to turn tiling off"),
    "micro_batch_size": (lambda v: v >= 1, "must be >= 1", "use a positive number of completions, e.g. 8"),
    "logprob_chunk_size": (lambda v: v == "auto" or v >= 1, "must be >= 1", "use e.g. 256 tokens, or 'auto'"),
}
