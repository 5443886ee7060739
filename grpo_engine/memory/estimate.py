"""Predicts the peak accelerator memory of a GRPO run before it starts (``budget.py`` picks a plan with it).

The model is analytic: every term is a count of tensor elements times their bytes, from the model's
shape (its transformers config), the ``MemoryPlan`` and the workload. The peak is the largest of:

    resident  = weights + adapters + optimizer state (+ a frozen reference copy under full FT + KL)
    sampling  = resident + KV cache of B*G rows x (P + C) tokens + per-step logits [B*G, V] fp32
                (a GPU's CUDA-graph decoder keeps both for the run: counted in every phase)
                (+ a merged copy of the adapted weights with merge_lora_for_sampling,
                a packed copy of the large linear weights with pack_weights_for_sampling: kept in
                every phase under unmerged LoRA, whose frozen base is packed once)
    training  = resident + gradients + saved activations of one micro-batch + one layer's backward
                + one tile of lm_head logits (chunk x tile fp32, x3: logits, exp, gradient; the
                  chunk and tile of ``logprob_granularity``, chosen per device for "auto")
    optimizer = resident + gradients + the update's temporaries

Saved activations per token per layer are a·h + b·f + c·k bytes (hidden, intermediate, kv_heads *
head_dim), fitted per dtype and setup to saved-tensor-hook measurements on seven Llama shapes (docs/memory.md;
tests/test_memory_estimate.py: other shapes within 15%). Tensor memory is predicted, not the driver's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from grpo_engine.config import FrozenModel

if TYPE_CHECKING:  # the estimator reads a plan's fields; it never builds one (memory/budget.py does)
    from grpo_engine.memory.plan import LoRA, MemoryPlan

__all__ = ["ModelShape", "Workload", "MemoryEstimate", "estimate_memory", "logprob_granularity",
           "KNOWN_SHAPES", "GIB"]

GIB = 1024**3
PACK_MIN = 1 << 17  # grpo_engine.sampling.packed.MIN_ELEMENTS: the smallest weight packed for sampling
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# NF4: 4 bits per weight, one fp8 absmax per 64-weight block, and (double quantisation) one fp32
# scale per 256 blocks: 0.5 + 1/64 + 4/(64*256) bytes per quantised weight.
_NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
# bytes per token per layer: (x h, x f, x k), by (weights are 4-byte, every weight trained)
_ACT_BYTES = {
    (True, False): (30.0, 18.0, 11.0),
    (True, True): (40.0, 18.0, 11.0),
    (False, False): (40.0, 11.0, 6.0),
    (False, True): (25.0, 9.0, 6.0),
}
# mixed precision (float32 weights, 2-byte autocast), by every weight trained; fitted as above
_MIXED_ACT_BYTES = {False: (35.0, 8.0, 14.0), True: (39.5, 8.0, 6.5)}
_CHECKPOINT_CONSTANT = 6.0  # x h bytes per token outside the layers under checkpointing


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a Llama / Qwen2 / Mistral-style decoder that memory depends on.

    Example:
        >>> shape = KNOWN_SHAPES["qwen2.5-0.5b"]
        >>> round(shape.num_params / 1e6)
        494
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tie_embeddings: bool
    head_dim: int | None = None
    qkv_bias: bool = False

    @property
    def kv_dim(self) -> int:
        """kv_heads x head_dim: the width of one layer's keys (and of its values)."""
        return self.kv_heads * (self.head_dim or self.hidden // self.heads)

    @property
    def q_dim(self) -> int:
        return self.heads * (self.head_dim or self.hidden // self.heads)

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of every linear layer in one decoder layer (q, k, v, o, gate, up, down)."""
        h, f, q, k = self.hidden, self.intermediate, self.q_dim, self.kv_dim
        return [(h, q), (h, k), (h, k), (q, h), (h, f), (h, f), (f, h)]

    @property
    def linear_params(self) -> int:
        """Weights of the decoder layers' linear layers (what 4-bit quantisation packs)."""
        return self.layers * sum(i * o for i, o in self.linear_shapes())

    @property
    def num_params(self) -> int:
        """Every parameter: embeddings, linear layers, biases, norms, output head."""
        bias = self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0
        norms = self.layers * 2 * self.hidden + self.hidden
        head = 0 if self.tie_embeddings else self.vocab * self.hidden
        return self.vocab * self.hidden + self.linear_params + self.layers * bias + norms + head

    def adapted_shapes(self, lora: LoRA) -> list[tuple[int, int]]:
        """(in, out) of the linear layers of one decoder layer that the adapters target."""
        names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        targets = lora.target_modules
        return [s for n, s in zip(names, self.linear_shapes()) if targets == "all-linear" or n in targets]

    def lora_params(self, lora: LoRA) -> int:
        """Adapter parameters: r x (in + out) for every adapted linear layer."""
        return self.layers * sum(lora.r * (i + o) for i, o in self.adapted_shapes(lora))

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers config (object or dict), a folder with ``config.json``, or a name in
        ``KNOWN_SHAPES``."""
        if isinstance(config, ModelShape):
            return config
        if isinstance(config, str) and config.lower() in KNOWN_SHAPES:
            return KNOWN_SHAPES[config.lower()]
        if isinstance(config, (str, Path)):
            from transformers import AutoConfig

            try:
                config = AutoConfig.from_pretrained(str(config))
            except OSError as exc:
                raise ValueError(f"no model config at {str(config)!r}: pass a folder with config.json, "
                                 f"a hub id while online, or one of {sorted(KNOWN_SHAPES)}") from exc
        get = (config.get if isinstance(config, dict)
               else (lambda key, default=None: getattr(config, key, default)))
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                               "vocab_size") if get(k) is None]
        if missing:
            raise ValueError(f"the model config lacks {missing}; the estimator knows decoder-only "
                             "Llama / Qwen2 / Mistral-style configs")
        model_type = get("model_type", "")
        return cls(
            hidden=get("hidden_size"), layers=get("num_hidden_layers"), heads=get("num_attention_heads"),
            kv_heads=get("num_key_value_heads") or get("num_attention_heads"),
            intermediate=get("intermediate_size"),
            vocab=get("vocab_size"), tie_embeddings=bool(get("tie_word_embeddings", False)),
            head_dim=get("head_dim"), qkv_bias=bool(get("attention_bias", False)) or model_type == "qwen2",
        )


KNOWN_SHAPES: dict[str, ModelShape] = {  # from the released models' config.json
    "smollm2-135m": ModelShape(576, 30, 9, 3, 1536, 49_152, True),
    "qwen2.5-0.5b": ModelShape(896, 24, 14, 2, 4864, 151_936, True, qkv_bias=True),
    "qwen2.5-1.5b": ModelShape(1536, 28, 12, 2, 8960, 151_936, True, qkv_bias=True),
    "qwen2.5-3b": ModelShape(2048, 36, 16, 2, 11_008, 151_936, True, qkv_bias=True),
    "qwen2.5-7b": ModelShape(3584, 28, 28, 4, 18_944, 152_064, False, qkv_bias=True),
    "llama-3.2-1b": ModelShape(2048, 16, 32, 8, 8192, 128_256, True, head_dim=64),
}


class Workload(FrozenModel):
    """What one GRPO step processes.

    Example:
        >>> Workload(prompts_per_step=4, group_size=8, prompt_tokens=256, completion_tokens=1024).rows
        32
    """

    prompts_per_step: int = Field(4, description="B: prompts per step.")
    group_size: int = Field(8, description="G: completions per prompt.")
    prompt_tokens: int = Field(256, description="P: prompt length (the longest in a batch sets the width).")
    completion_tokens: int = Field(1024, description="C: completion length (plan for the maximum).")
    kl: bool = Field(
        False, description="A KL term to a reference policy (a frozen copy under full fine-tuning)."
    )

    @property
    def rows(self) -> int:
        return self.prompts_per_step * self.group_size

    @classmethod
    def from_config(cls, config: Any, *, prompt_tokens: int | None = None, kl: bool = False,
                    ranks: int = 1) -> Workload:
        """From a ``GRPOConfig``: its B, G, and maximum prompt and completion lengths; with ``ranks``,
        what one data-parallel rank processes (:meth:`per_rank`)."""
        return cls(prompts_per_step=config.prompts_per_step, group_size=config.group_size,
                   prompt_tokens=prompt_tokens or config.max_prompt_tokens,
                   completion_tokens=config.max_completion_tokens, kl=kl).per_rank(ranks)

    def per_rank(self, ranks: int) -> Workload:
        """What one of ``ranks`` data-parallel ranks processes: B / ranks prompts (each rank also holds
        the whole model, its gradients and optimizer state, so only the rows' memory shrinks).

        Example:
            >>> Workload(prompts_per_step=8, group_size=8).per_rank(4).rows
            16
        """
        if ranks < 1 or self.prompts_per_step % ranks:
            raise ValueError(f"prompts_per_step={self.prompts_per_step} does not split across ranks={ranks}: "
                             "each rank samples an equal share of the prompts; use a multiple "
                             "of the number of ranks")
        return self.model_copy(update={"prompts_per_step": self.prompts_per_step // ranks})


Workload.field_rules = {
    name: (lambda v: v >= 1, "must be >= 1", f"set {name} to a positive integer")
    for name in ("prompts_per_step", "group_size", "prompt_tokens", "completion_tokens")
}


@dataclass(frozen=True)
class MemoryEstimate:
    """The predicted memory of each part (bytes) and the peak over the phases of a step."""

    parts: dict[str, float]
    phases: dict[str, float]
    # (tokens per chunk, vocabulary entries per tile or None) of the lm_head pass the estimate assumed
    logprob_granularity: tuple[int, int | None] = (256, 32768)

    @property
    def peak_bytes(self) -> float:
        return max(self.phases.values())

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.__getitem__)

    def table(self) -> str:
        """The breakdown as aligned text, GiB."""
        lines = [f"{'part':<28}{'GiB':>9}"]
        lines += [f"{name:<28}{value / GIB:>9.3f}" for name, value in self.parts.items()]
        chunk, tile = self.logprob_granularity
        lines.append(f"(log-prob pass: chunks of {chunk} tokens x "
                     + (f"tiles of {tile} vocabulary entries)" if tile else "the whole vocabulary)"))
        lines.append("")
        lines += [f"{'phase: ' + name:<28}{value / GIB:>9.3f}"
                  + ("  <- peak" if name == self.peak_phase else "")
                  for name, value in self.phases.items()]
        return "\n".join(lines)


def estimate_memory(model: Any, plan: MemoryPlan, workload: Workload, *, ranks: int = 1,
                    sampler: str = "ours", device: str = "cuda", budget_bytes: float | None = None
                    ) -> MemoryEstimate:
    """Predicts the peak tensor memory of one GRPO step, by part and by phase (of one rank).

    Args:
        model: a ``ModelShape``, a transformers config, a folder with ``config.json`` or a name in
            ``KNOWN_SHAPES``.
        plan: the memory plan.
        workload: B, G, prompt and completion lengths, KL on/off (one rank's: ``Workload.per_rank``).
        ranks: torchrun processes. With ``plan.sharding="fsdp"`` each rank holds 1/ranks of the
            decoder's weights, adapters, gradients and AdamW states (the lm_head, or an embedding tied
            to it, whole), gathers the whole model while sampling and two layers while training.
        sampler: ``"ours"`` (the library's decoder: its KV cache and logits are counted while sampling) or
            ``"vllm"`` (a colocated ``VLLMSampler`` with adapter sync: the engine's KV cache lives in its own
            ``gpu_memory_utilization`` share, which is not counted here, so sampling adds nothing to what
            the trainer holds).
        device: ``"cuda"`` (an accelerator, the default) or ``"cpu"``: where ``"auto"`` log-prob chunks and
            tiles are chosen for (:func:`logprob_granularity`).
        budget_bytes: the memory the training phase may reach; with ``"auto"`` chunks and tiles on a GPU,
            the log-prob pass takes the fewest passes whose logits fit in what the rest leaves of it
            (``memory.budget`` passes its budget); None: the fewest passes, one chunk and one tile.

    Example:
        >>> from grpo_engine.memory.plan import LoRA, MemoryPlan
        >>> est = estimate_memory("qwen2.5-0.5b", MemoryPlan(lora=LoRA(r=16), dtype="bfloat16"),
        ...                       Workload(prompts_per_step=4, group_size=8, prompt_tokens=128,
        ...                                completion_tokens=256))
        >>> est.peak_phase, round(est.parts["weights"] / 2**20)
        ('training', 942)
    """
    if sampler not in ("ours", "vllm"):
        raise ValueError(f"sampler={sampler!r} is not a sampler the estimate knows; use 'ours' (HFSampler) "
                         "or 'vllm' (VLLMSampler, whose engine takes its own share of the accelerator)")
    s = ModelShape.from_config(model)
    w = workload
    dt = _BYTES[plan.dtype]  # weights
    ct = _BYTES[plan.compute_dtype] if plan.mixed_precision else dt  # what a forward pass computes in
    parts: dict[str, float] = {}

    # resident: weights, adapters, optimizer state (FSDP2: a 1/K share of all but one vocab x hidden matrix)
    k = ranks if plan.sharding == "fsdp" and ranks > 1 else 1
    whole = s.vocab * s.hidden  # replicated under FSDP2: the lm_head, or the embedding tied to it
    # n counts every parameter; all of them but the head are split
    share = lambda n: (n - whole) / k + whole  # noqa: E731
    if plan.quantization is not None:
        parts["weights"] = (s.num_params - s.linear_params) * dt + s.linear_params * _NF4_BYTES
    else:
        parts["weights"] = share(s.num_params) * dt
    if plan.lora is not None:
        trainable, grad_bytes, state_dtype_bytes = s.lora_params(plan.lora) / k, 4, 4  # fp32 master adapters
        parts["adapters"] = trainable * 4
    else:
        trainable, grad_bytes, state_dtype_bytes = share(s.num_params), dt, dt  # AdamW states in param dtype
        parts["adapters"] = 0
    # FSDP2: the rest of the model while sampling; two decoder layers (one prefetched) while training
    gathered = gathered_layers = 0.0
    if k > 1:
        gathered = (s.num_params - share(s.num_params)) * dt + (
            s.lora_params(plan.lora) * 4 - parts["adapters"] if plan.lora is not None else 0)
        gathered_layers = 2 * (s.num_params - whole) / s.layers * dt
        parts.update(gathered_weights=gathered, gathered_layers=gathered_layers)
    eight_bit = plan.optimizer in ("adamw8bit", "paged_adamw8bit")
    parts["optimizer_state"] = trainable * (2 if eight_bit else 2 * state_dtype_bytes)
    parts["reference_copy"] = parts["weights"] if (w.kl and plan.lora is None) else 0
    resident = parts["weights"] + parts["adapters"] + parts["optimizer_state"] + parts["reference_copy"]

    # sampling: the KV cache of every row, and one decoding step's logits (fp32, a few copies)
    length = w.prompt_tokens + w.completion_tokens
    parts["kv_cache"] = w.rows * length * s.layers * 2 * s.kv_dim * ct
    # mixed precision: autocast keeps a compute-dtype copy of every matmul weight while a forward runs
    parts["autocast_weights"] = (s.linear_params + s.vocab * s.hidden) * ct if plan.mixed_precision else 0
    parts["sampling_logits"] = w.rows * s.vocab * 4 * 3
    # merge_lora_for_sampling: a merged copy of every adapted weight while sampling
    merged = (s.layers * sum(i * o for i, o in s.adapted_shapes(plan.lora))
              if plan.merge_lora_for_sampling else 0)
    parts["merged_weights"] = merged * dt
    # pack_weights_for_sampling: a packed float32 copy of every linear weight large enough to pack
    # (a 4-bit layer is not packed: then only the output head)
    packed = [(s.hidden, s.vocab)] + (s.linear_shapes() * s.layers if plan.quantization is None else [])
    parts["packed_weights"] = 4 * sum(i * o for i, o in packed if i * o >= PACK_MIN) \
        if plan.pack_weights_for_sampling else 0
    # the frozen base of unmerged LoRA stays packed between sampling calls: in every phase
    kept_packs = parts["packed_weights"] if plan.lora is not None and not plan.merge_lora_for_sampling else 0
    # a GPU's CUDA-graph decoding keeps its decoder for the run (the graphs hold their buffers' addresses):
    # its KV cache and the step's buffers in the graphs' pool stay allocated while training
    graphs = (plan.decoding == "cuda_graph" or plan.decoding == "auto" and device == "cuda") and \
        not plan.merge_lora_for_sampling
    parts["kept_decoder"] = parts["kv_cache"] + parts["sampling_logits"] if graphs else 0
    kept_packs += parts["kept_decoder"]
    if sampler == "vllm":  # the engine's own share holds its weights and KV cache; no forward pass here
        parts.update(kv_cache=0, sampling_logits=0, merged_weights=0, packed_weights=0, kept_decoder=0)
        kept_packs = 0
        sampling = resident + gathered
    else:
        sampling = (resident + parts["kv_cache"] + parts["sampling_logits"] + parts["merged_weights"]
                    + parts["packed_weights"] + parts["autocast_weights"] + gathered)

    # training: gradients, saved activations of one micro-batch, one layer's backward, one logits tile
    parts["gradients"] = trainable * grad_bytes
    m = min(plan.micro_batch_size, w.rows)
    groups_in_micro = math.ceil(m / w.group_size) if plan.share_prompt else m
    tokens = m * w.completion_tokens + groups_in_micro * w.prompt_tokens
    if plan.share_prompt and plan.gradient_checkpointing:  # no KV cache under checkpointing: full rows
        tokens = m * length
    a_h, a_f, a_k = (_MIXED_ACT_BYTES[plan.lora is None] if plan.mixed_precision
                     else _ACT_BYTES[(dt == 4, plan.lora is None)])
    per_layer = a_h * s.hidden + a_f * s.intermediate + a_k * s.kv_dim  # bytes per token
    one_layer = tokens * per_layer
    if plan.gradient_checkpointing:
        saved = tokens * (s.layers * s.hidden * dt + _CHECKPOINT_CONSTANT * s.hidden)
    else:
        saved = tokens * s.layers * per_layer
    if plan.offload_activations:
        saved = 0.0  # kept in CPU memory
    parts["activations"] = saved
    parts["layer_backward"] = one_layer  # recomputed layer (checkpointing) or its gradient buffers
    training = (resident + parts["gradients"] + saved + one_layer + parts["autocast_weights"]
                + gathered_layers + kept_packs)
    left = budget_bytes - training if budget_bytes is not None else None  # for the logits
    granularity = logprob_granularity(s.vocab, plan, m * w.completion_tokens, device=device,
                                      logits_bytes=left)
    chunk, tile = granularity
    parts["logprob_tile"] = min(chunk, m * w.completion_tokens) * min(tile or s.vocab, s.vocab) * LOGIT_BYTES
    training += parts["logprob_tile"]

    # optimizer step: the fused AdamW (build_optimizer's choice) makes no temporaries; under FSDP2, full
    # fine-tuning's shards beside the whole head take the per-tensor AdamW: two temporaries of its largest
    parts["optimizer_temporaries"] = (2 * whole * state_dtype_bytes
                                      if k > 1 and plan.lora is None and not eight_bit else 0)
    optimizer = resident + parts["gradients"] + parts["optimizer_temporaries"] + kept_packs
    return MemoryEstimate(
        parts=parts, phases={"sampling": sampling, "training": training, "optimizer": optimizer},
        logprob_granularity=granularity,
    )


LOGIT_BYTES = 4 * 3  # per logit of the lm_head pass: float32 logits, their exponentials, their gradient
CPU_GRANULARITY = (256, 32768)  # small passes: a CPU's caches, and little memory held at once
MIN_CHUNK, MIN_TILE = 256, 8192  # the smallest a GPU's plan cuts to


def logprob_granularity(vocab: int, plan: MemoryPlan, tokens: int, *, device: str,
                        logits_bytes: float | None = None) -> tuple[int, int | None]:
    """``(tokens per chunk, vocabulary entries per tile)`` of the lm_head pass over a micro-batch of
    ``tokens`` scored tokens, with a ``vocab``-entry vocabulary: the plan's own numbers where it gives them
    (a tile of None: whole-vocabulary chunks); for ``"auto"``, on the CPU 256 x 32,768 (small passes); on a
    GPU the fewest passes (chunks x tiles) whose logits (chunk x tile x 12 bytes: float32 logits, their
    exponentials, their gradient) fit in ``logits_bytes``, one chunk of the whole micro-batch and one tile
    of the whole vocabulary where they fit (None: no limit), else halving the chunk down to 256 tokens, then
    the tile down to 8,192 entries. Fewer passes are fewer, larger matrix products: each pass of the CPU's
    granularity is a few small kernels.

    Example:
        >>> from grpo_engine.memory.plan import MemoryPlan
        >>> logprob_granularity(151_936, MemoryPlan(), 16 * 512, device="cuda")
        (8192, 151936)
        >>> logprob_granularity(151_936, MemoryPlan(), 16 * 512, device="cuda", logits_bytes=2 * 2**30)
        (1024, 151936)
        >>> logprob_granularity(151_936, MemoryPlan(), 16 * 512, device="cpu")
        (256, 32768)
    """
    chunk, tile = plan.logprob_chunk_size, plan.logprob_vocab_tile
    if device != "cuda":
        return (CPU_GRANULARITY[0] if chunk == "auto" else chunk,
                CPU_GRANULARITY[1] if tile == "auto" else tile)
    tokens = max(tokens, 1)
    chunks = [chunk] if chunk != "auto" else _halvings(tokens, MIN_CHUNK)
    tiles = [tile] if tile != "auto" else _halvings(vocab, MIN_TILE)
    # the fewest passes; among as many, whole-vocabulary tiles (one logsumexp, no running one)
    def passes(c: int, t: int | None) -> tuple[int, int, int]:
        return math.ceil(tokens / c) * math.ceil(vocab / (t or vocab)), -(t or vocab), -c

    for c, t in sorted(((c, t) for c in chunks for t in tiles), key=lambda ct: passes(*ct)):
        if logits_bytes is None or min(c, tokens) * min(t or vocab, vocab) * LOGIT_BYTES <= logits_bytes:
            return c, t
    return min(chunks), min(tiles, key=lambda t: t or vocab)  # nothing fits: the smallest


def _halvings(size: int, smallest: int) -> list[int]:
    """``size``, then halved (rounded up) while it stays at or above ``smallest``."""
    out = [size]
    while math.ceil(out[-1] / 2) >= smallest:
        out.append(math.ceil(out[-1] / 2))
    return out
