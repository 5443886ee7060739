"""GRPO step time, stage split, generation throughput and peak memory: grpo_engine against TRL.

Both engines train the same random-init model (built from the same seed) on the same prompts with
the same settings, each (engine, repetition) in a fresh process so that peak memory is its own:
ours, trl, ours, trl, ... The parent prints a summary, then one JSON object as its last line.

    python benchmarks/perf.py --preset cpu-small [--repetitions 2] [--set lora_r=16] [--out r.json]
    python benchmarks/perf.py --preset gpu-1.5b --smoke   # the same preset shrunk to a tiny CPU run

Settings that are forced equal (each worker reports what its engine actually holds; the parent
compares them and fails if they differ):

- B prompts per step and G completions per prompt. TRL: ``num_generations=G``,
  ``per_device_train_batch_size=m`` (completions per forward/backward, our ``micro_batch_size``),
  ``gradient_accumulation_steps = B*G/m`` and ``steps_per_generation`` left to default to it, so
  one TRL optimizer step consumes exactly the B*G completions of one generation.
- Prompt tokens (every prompt has exactly P words of a word-level tokenizer, no template, no BOS)
  and completion tokens: EOS is an id outside the model's vocabulary, so every completion has
  exactly C tokens; both workers report the min and max they saw.
- LoRA (r, alpha, dropout 0, all linear layers but the lm_head) or full fine-tuning; gradient
  checkpointing (non-reentrant); the precision: the weights' dtype and the compute dtype (a LoRA
  preset: a bfloat16 base, float32 adapters, TRL's bf16 flag; a full fine-tuning preset on a GPU:
  float32 master weights under bfloat16 autocast, ours ``MemoryPlan(compute_dtype="bfloat16")``,
  TRL's bf16 flag on a float32 model); KL coefficient; PPO clip 0.2; per-sequence mean aggregation
  (ours ``ClippedSurrogate(aggregation="sequence")``, TRL ``loss_type="grpo"``); group z-score
  advantages (std + 1e-4, TRL's); AdamW with the same lr, betas, eps, no weight decay, constant lr,
  gradient clipping at 1.0 (torch's fused kernel, TRL's default with torch >= 2.8, ours on a GPU and
  on the CPU); temperature 1, no top-p / top-k; no vLLM ("TRL without vLLM": its transformers
  generation path); no logging or saving.
- The reward: a CRC of the completion text (``_models.hash_score``).

Stages, timed without adding a synchronisation inside either step (``_measure.StageClock``: CUDA
events on a GPU, read once after the step), at the same boundaries for both engines:

- generation: ours ``sampler.sample`` (the sampler also marks the end of its prefill, which splits it
  into prefill and decode); TRL ``_generate``;
- log-prob passes without gradient (old / reference policy): ours the gradient pass's ``logprobs``;
  TRL ``_get_per_token_logps_and_entropies`` under no_grad;
- loss + backward: ours the trainer's gradient pass (``PolicyGradient.__call__``: every micro-batch's
  forward, loss and backward) plus its gradient clipping (``World.clip_grad_norm``); TRL
  ``training_step`` minus ``_prepare_inputs`` (each micro-batch's forward, loss and backward) plus
  accelerate's ``clip_grad_norm_``;
- optimizer: ours ``optimizer.step``; TRL between the ``on_pre_optimizer_step`` and
  ``on_optimizer_step`` callbacks;
- reward: ours the trainer's own timer (host work); TRL ``_calculate_rewards``;
- ``other_s``: the step time in none of them, reported for both (ours: the prompt stream, the
  advantages, the metrics and the callbacks; TRL: its input preparation besides generation, logging).

A step is timed from the end of the previous one (TRL: between ``on_step_end`` callbacks), so it
includes fetching the prompts. Each worker also records its timeline, seconds from its launch to the
end of its imports, of its build and of each step (``times``).

Peak memory, overall and per phase (sampling, training, optimizer; ``_measure.PhaseMemory``): on
CPU the peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs`` when training starts and at
each phase: the model, the imports and the trainer are in it, a transient peak while building them
is not); on GPU ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` (weights included).

Derived per engine (``_measure``): decode's fraction of the HBM roofline and training MFU, each
against the ceilings the GPU run's preflight measured on the machine (``--preflight``: an 8192^3
bfloat16 matrix product, a device-to-device copy) and against the card's data-sheet peaks; the time
from the worker's launch to the end of its first step; ours also the memory estimator's prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import _harness as harness
import _trl as trl
from _measure import (
    BYTES,
    NF4_BYTES,
    PhaseMemory,
    StageClock,
    Wrapped,
    ceilings,
    decode_roofline,
    status_kib,
    training_mfu,
)
from _models import SHAPES, build_model, count_params, hash_score, make_prompts, word_tokenizer

STAGES = ("generation_s", "reward_s", "logprobs_s", "loss_backward_s", "optimizer_s", "other_s")


@dataclasses.dataclass(frozen=True)
class Preset:
    """One benchmark configuration; every field is applied identically to both engines."""

    shape: str  # a key of _models.SHAPES
    device: str = "cpu"  # "cpu" or "cuda"
    dtype: str = "float32"  # the weights'
    compute_dtype: str | None = None  # mixed precision: autocast to this dtype (float32 weights)
    prompts_per_step: int = 2  # B
    group_size: int = 4  # G
    prompt_tokens: int = 32
    completion_tokens: int = 64
    micro_batch_size: int = 4  # completions per forward/backward
    lora_r: int | None = None  # None = full fine-tuning
    lora_alpha: float = 32.0
    gradient_checkpointing: bool = False
    quantization: str | None = None  # "nf4": a 4-bit base (ours only: run with --engines ours)
    kl_coef: float = 0.0
    learning_rate: float = 1e-5
    warmup_steps: int = 1
    measured_steps: int = 3
    trl_measured_steps: int | None = None  # TRL's worker (default: measured_steps)
    # TRL's warm-up step generates only this many tokens (None: in full). Its warm-up loads kernels, Triton's
    # JIT and the allocator, none of which depends on the length; ours keeps a full warm-up, where the CUDA
    # graph and the compiled kernels are made at the measured shapes.
    trl_warmup_completion_tokens: int | None = None
    repetitions: int = 2
    worker_timeout_s: float = 600.0  # ours; a fixed limit per worker
    trl_timeout_s: float | None = None  # TRL's worker (default: worker_timeout_s)
    decoding: str = "auto"  # our sampler's decoding path (MemoryPlan.decoding)
    # a GPU's CUDA graphs replay the torch.compile'd decoding step (MemoryPlan.compile_decoding, its
    # default): two compiles in our warm-up step; False: the eager step (no compile time)
    compile_decoding: bool = True
    # ours: the log-prob pass's chunks and tiles fitted into this memory budget (GiB) as `grpo-engine plan
    # --budget-gib` fits them (its 15% margin); None: MemoryPlan's "auto" for the device
    budget_gib: float | None = None
    # the training forward through torch.compile: ours MemoryPlan(compile_training=True), TRL
    # torch_compile=True (transformers' Trainer compiles the model it trains)
    compile_training: bool = False
    # ours only (CPU): MemoryPlan(pack_weights_for_sampling=True), oneDNN-packed linear weights while sampling
    pack_weights_for_sampling: bool = False
    # ours only (CPU, decoding="compiled"): MemoryPlan(compiled_products_for_sampling=True), the compiled
    # step's linear products in its own loops
    compiled_products_for_sampling: bool = False
    # torch CPU threads (None = every core). The CPU presets use 1: on a shared 2-core machine a second
    # busy process stalls a 2-thread OpenMP pool at every barrier (steps measured 5-10x slower).
    threads: int | None = None
    seed: int = 0


PRESETS: dict[str, Preset] = {
    "micro": Preset("micro", prompts_per_step=2, group_size=2, prompt_tokens=8, completion_tokens=8,
                    micro_batch_size=2, warmup_steps=1, measured_steps=2, repetitions=1, worker_timeout_s=300,
                    threads=1),
    "cpu-small": Preset("llama-small", prompts_per_step=2, group_size=4, prompt_tokens=32,
                        completion_tokens=64, micro_batch_size=4, warmup_steps=1, measured_steps=4,
                        repetitions=2, threads=1),
    "cpu-logits": Preset("qwen2-logits", prompts_per_step=2, group_size=4, prompt_tokens=32,
                         completion_tokens=64, micro_batch_size=4, warmup_steps=1, measured_steps=3,
                         repetitions=2, threads=1),
    # The GPU presets (benchmarks/gpu/run.sh): ours 1 warm-up + 2 measured steps, TRL 1 short warm-up
    # (16 tokens) + 1 measured, each worker under a fixed limit (their sum is the run's time plan,
    # tests/test_gpu_run.py); a worker prints its result after each measured step, so one cut at its limit
    # keeps what it measured. The limits, from the first run (2026-12-04, an H200): our 1.5B worker ended
    # its third step (12.7 s each) within 60 s; TRL's 0.5B worker ended two steps (13.6 s) but not three in
    # 80 s, so its imports, build and first-step overheads (Triton's JIT) took 39-53 s; TRL's 1.5B worker
    # ended no second step in 100 s. Since then our warm-up step also compiles the decoding step twice
    # (compile_decoding, not measured on a GPU yet): our workers have 40-50 s more than their steps need.
    # Full fine-tuning in float32 master weights under bfloat16 autocast (TRL: bf16=True on a float32 model)
    "gpu-0.5b": Preset("qwen2.5-0.5b", device="cuda", dtype="float32", compute_dtype="bfloat16",
                       prompts_per_step=8, group_size=8, prompt_tokens=128, completion_tokens=512,
                       micro_batch_size=16, learning_rate=1e-6, warmup_steps=1, measured_steps=2,
                       trl_measured_steps=1, trl_warmup_completion_tokens=16, repetitions=1,
                       worker_timeout_s=85, trl_timeout_s=70, decoding="cuda_graph"),
    # LoRA r16 on Qwen2.5-1.5B, 4 x 8 x 1024, under the plan `grpo-engine plan --model qwen2.5-1.5b
    # --budget-gib 8` picks (gradient checkpointing), the same plan for TRL: the 8 GiB goal and the
    # memory ratio are judged here
    "gpu-1.5b": Preset("qwen2.5-1.5b", device="cuda", dtype="bfloat16", prompts_per_step=4, group_size=8,
                       prompt_tokens=128, completion_tokens=1024, micro_batch_size=8, lora_r=16,
                       lora_alpha=32.0, gradient_checkpointing=True, learning_rate=1e-5, warmup_steps=1,
                       measured_steps=2, trl_measured_steps=1, trl_warmup_completion_tokens=16, repetitions=1,
                       worker_timeout_s=110, trl_timeout_s=95, decoding="cuda_graph", budget_gib=8.0),
    # a 7B shape under QLoRA (ours only: --engines ours), the second run (run.sh --part 2): the 12 GiB goal
    # is its peak, which one measured step shows; the eager step in its CUDA graphs (no compile time)
    "gpu-7b-qlora": Preset("qwen2.5-7b", device="cuda", dtype="bfloat16", prompts_per_step=4, group_size=8,
                           prompt_tokens=128, completion_tokens=1024, micro_batch_size=4, lora_r=16,
                           lora_alpha=32.0, gradient_checkpointing=True, quantization="nf4",
                           learning_rate=1e-5, warmup_steps=1, measured_steps=1, repetitions=1,
                           worker_timeout_s=110, decoding="cuda_graph", compile_decoding=False),
}


def smoke(p: Preset) -> Preset:
    """The preset shrunk to a tiny CPU run (``--smoke``): the same engines, precision, LoRA,
    checkpointing and quantization through the same workers and JSON, on the "smoke" Qwen2 shape.

    Example:
        >>> smoke(PRESETS["gpu-1.5b"]).shape, smoke(PRESETS["gpu-1.5b"]).lora_r
        ('smoke', 16)
    """
    return dataclasses.replace(p, shape="smoke", device="cpu", prompts_per_step=2, group_size=2,
                               prompt_tokens=8, completion_tokens=8, micro_batch_size=2, warmup_steps=1,
                               measured_steps=3, trl_measured_steps=None, repetitions=1, threads=1,
                               worker_timeout_s=60.0, trl_timeout_s=60.0,
                               trl_warmup_completion_tokens=2 if p.trl_warmup_completion_tokens else None,
                               # the GPU's fixed-shape path, eager (no CUDA graph on the CPU)
                               decoding="static" if p.decoding in ("auto", "cuda_graph") else p.decoding)


# -- measuring --------------------------------------------------------------------------------


class MemoryMeter:
    """Baseline, overall peak and per-phase peaks of the training loop (see the module docstring)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.scope = "training loop"
        self.phases = PhaseMemory(device)

    def start(self) -> None:
        if self.device == "cuda":
            import gc

            import torch

            torch.cuda.synchronize()  # before the loop: the baseline is what is resident when training starts
            gc.collect()  # what set-up dropped (quantize_4bit_'s bfloat16 originals) leaves the reserved peak
            torch.cuda.empty_cache()
            self.baseline = torch.cuda.memory_allocated()
        else:
            self.setup_peak = status_kib("VmHWM")
            self.baseline = (status_kib("VmRSS") or 0) * 1024
            if not Path("/proc/self/clear_refs").exists():
                self.scope = "process"  # VmHWM cannot be reset: the peak is the whole process's
        self.phases.enter("training")  # resets the peaks

    def phase(self, name: str) -> None:
        self.phases.enter(name)

    def finish(self, final: bool = True) -> dict:
        """The figures so far; ``final=False`` (a partial result after a step) keeps measuring."""
        phases = self.phases.finish() if final else self.phases.snapshot()
        peak = max(v["allocated_mib"] for v in phases.values()) if phases else 0.0
        reserved = [v["reserved_mib"] for v in phases.values() if v["reserved_mib"] is not None]
        setup = getattr(self, "setup_peak", None)
        base = self.baseline / 2**20
        return {"peak_mib": peak, "baseline_mib": base, "peak_above_baseline_mib": peak - base,
                "peak_scope": self.scope, "peak_reserved_mib": max(reserved) if reserved else None,
                "setup_peak_mib": setup / 1024 if setup is not None else None, "phases_mib": phases}


def _step_row(step_s: float, stages: dict[str, float], lengths: dict[str, int]) -> dict:
    row = {"step_s": step_s, **{k: stages.get(k, 0.0) for k in STAGES if k != "other_s"}, **lengths}
    row["other_s"] = step_s - sum(row[k] for k in STAGES if k != "other_s")
    return row


def _lengths(prompt_lengths, completion_lengths) -> dict[str, int]:
    return {"prompt_tokens_min": int(min(prompt_lengths)), "prompt_tokens_max": int(max(prompt_lengths)),
            "completion_tokens_min": int(min(completion_lengths)),
            "completion_tokens_max": int(max(completion_lengths)),
            "generated_tokens": int(sum(completion_lengths))}


def _setup(p: Preset):
    import torch

    torch.set_num_threads(p.threads or os.cpu_count() or 1)
    if p.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"preset device is cuda but torch {torch.__version__} sees no GPU")
    shape = SHAPES[p.shape]
    model = build_model(shape, seed=p.seed, dtype=p.dtype, device=p.device)
    texts = make_prompts(max(64, p.prompts_per_step * (p.warmup_steps + p.measured_steps)), p.prompt_tokens,
                         shape.vocab, seed=p.seed)
    return model, word_tokenizer(shape.vocab), texts


# -- the two workers ------------------------------------------------------------------------------


def _since_launch() -> float:
    """Seconds since the parent launched this worker (the worker's timeline)."""
    return round(time.time() - harness.launched_at(), 2)


def _sync(device: str) -> None:
    """Waits for the GPU: only between steps, never inside one."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def run_ours(p: Preset, workdir: str, progress=lambda raw: None) -> dict:
    from grpo_engine import ClippedSurrogate, GRPOConfig, GRPOTrainer, LoRA, MemoryPlan, Prompt, Reward
    from grpo_engine.advantages import GroupNormalized
    from grpo_engine.data.templates import PlainTemplate
    from grpo_engine.memory.estimate import Workload, estimate_memory
    from grpo_engine.sampling.hf import resolve_decoding

    class HashReward(Reward):
        def score(self, prompt, completion):
            return hash_score(completion)

    times = {"imported_s": _since_launch()}
    model, tokenizer, texts = _setup(p)
    config = GRPOConfig(
        prompts_per_step=p.prompts_per_step, group_size=p.group_size, max_prompt_tokens=p.prompt_tokens,
        max_completion_tokens=p.completion_tokens, max_steps=p.warmup_steps + p.measured_steps,
        temperature=1.0, top_p=1.0, top_k=0, learning_rate=p.learning_rate, lr_schedule="constant",
        warmup_steps=0, weight_decay=0.0,
        adam_betas=(0.9, 0.99), adam_eps=1e-8, max_grad_norm=1.0, seed=p.seed, output_dir=workdir,
        progress_bar=False,
    )
    lora = (LoRA(r=p.lora_r, alpha=p.lora_alpha, dropout=0.0, target_modules="all-linear") if p.lora_r
            else None)
    memory = MemoryPlan(lora=lora, gradient_checkpointing=p.gradient_checkpointing,
                        quantization=p.quantization, micro_batch_size=p.micro_batch_size, dtype=p.dtype,
                        compute_dtype=p.compute_dtype, decoding=p.decoding,
                        compile_decoding=p.compile_decoding, compile_training=p.compile_training,
                        pack_weights_for_sampling=p.pack_weights_for_sampling,
                        compiled_products_for_sampling=p.compiled_products_for_sampling)
    workload = Workload(prompts_per_step=p.prompts_per_step, group_size=p.group_size, kl=p.kl_coef > 0,
                        prompt_tokens=p.prompt_tokens, completion_tokens=p.completion_tokens)
    if p.budget_gib is not None:  # the chunks and tiles the plan for that budget takes
        fitted = estimate_memory(model.config, memory, workload, device=p.device,
                                 budget_bytes=p.budget_gib / 1.15 * 2**30).logprob_granularity
        memory = memory.model_copy(update=dict(zip(("logprob_chunk_size", "logprob_vocab_tile"), fitted)))
    predicted = estimate_memory(model.config, memory, workload, device=p.device)
    loss = ClippedSurrogate(clip_eps_low=0.2, kl_coef=p.kl_coef, aggregation="sequence")
    trainer = GRPOTrainer(model, [HashReward()], [Prompt(t) for t in texts], config, memory,
                          tokenizer=tokenizer, advantage=GroupNormalized(eps=trl.ADVANTAGE_EPS), loss=loss,
                          template=PlainTemplate("{question}"))
    times["built_s"] = _since_launch()
    clock, meter, seen = StageClock(p.device), MemoryMeter(p.device), {}
    calls = _time_ours(trainer, clock, meter, seen)

    def snapshot(final: bool) -> dict:  # the result so far: after each measured step, and at the end
        decoding = trainer.sampler.last_decoding.get("path") or resolve_decoding(
            memory.decoding, trainer.model, next(trainer.model.parameters()).device)
        return {"rows": rows, "memory": meter.finish(final), "settings": trl.ours_settings(trainer),
                "trainable_params": sum(x.numel() for x in trainer.model.parameters() if x.requires_grad),
                "times": times, "predicted_peak_mib": predicted.peak_bytes / 2**20,
                "predicted_phases_mib": {k: v / 2**20 for k, v in predicted.phases.items()},
                "decoding": decoding + (", packed weights" if memory.pack_weights_for_sampling else "")
                + (", compiled products" if memory.compiled_products_for_sampling else ""),
                "decoding_fallback": trainer.sampler.last_decoding.get("capture_error"),
                "prompt_sharing_in_training": memory.share_prompt and not memory.gradient_checkpointing}

    rows = []
    meter.start()
    for _ in range(p.warmup_steps + p.measured_steps):
        _sync(p.device)
        start = time.perf_counter()
        m = trainer.step()
        stages = clock.seconds()  # synchronises once, after the step
        step_s = time.perf_counter() - start
        times.setdefault("steps_end_s", []).append(_since_launch())
        if not (calls["gradients"] and calls["clip"]):  # the trainer reached them another way: say so
            raise SystemExit(f"ours: the loss + backward boundary timed no call ({calls}); the trainer no "
                             "longer calls trainer.gradients(...) and trainer.world.clip_grad_norm: fix "
                             "_time_ours")
        phases = trainer.sampler.last_clock.seconds() if trainer.sampler.last_clock is not None else {}
        stages["reward_s"] = m["time/reward_s"]  # host work (the trainer's wall-clock timer)
        row = _step_row(step_s, stages, seen)
        row.update(prefill_s=phases.get("prefill"), decode_s=phases.get("decode"))
        rows.append(row)
        if len(rows) > p.warmup_steps:
            progress(snapshot(final=False))
    return snapshot(final=True)


def _time_ours(trainer, clock: StageClock, meter: MemoryMeter, seen: dict) -> dict[str, int]:
    """Our trainer's stages timed at TRL's boundaries (module docstring): sampling, the no-grad log-prob
    passes, the gradient pass plus clipping (``loss_backward_s``), the optimizer step. Returns the count
    of gradient passes and clippings seen (the caller checks that the boundary caught them)."""
    calls = {"gradients": 0, "clip": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    def entering(phase, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            meter.phase(phase)
            out = fn(*args, **kwargs)
            meter.phase("training")
            return out
        return wrapper

    def record(batch):  # after sampling, which ends on the host anyway (the texts are decoded)
        seen.update(_lengths(batch.prompt_mask.sum(1).tolist(), batch.completion_lengths.tolist()))

    gradients, world = trainer.gradients, trainer.world
    gradient_pass = clock.wrap("loss_backward_s", counted("gradients", gradients))
    no_grad_pass = clock.wrap("logprobs_s", gradients.logprobs)
    trainer.gradients = Wrapped(gradients, call=gradient_pass, logprobs=no_grad_pass)
    trainer.world = Wrapped(world, clip_grad_norm=clock.wrap("loss_backward_s",
                                                             counted("clip", world.clip_grad_norm)))
    trainer.optimizer.step = entering("optimizer", clock.wrap("optimizer_s", trainer.optimizer.step))
    trainer.sampler.sample = entering("sampling",
                                      clock.wrap("generation_s", trainer.sampler.sample, after=record))
    return calls


def run_trl(p: Preset, workdir: str, progress=lambda raw: None) -> dict:
    import torch
    from datasets import Dataset

    times = {"imported_s": _since_launch()}
    model, tokenizer, texts = _setup(p)
    if p.kl_coef and not p.lora_r:  # TRL builds a full-FT reference model from a path: give it one
        model.save_pretrained(f"{workdir}/policy")
        model.config._name_or_path = f"{workdir}/policy"
    compute = p.compute_dtype or p.dtype
    warmup, measured = p.warmup_steps, p.trl_measured_steps or p.measured_steps

    def hash_reward(completions, **kwargs):
        return [hash_score(c) for c in completions]

    trainer = trl.build(
        model, tokenizer, Dataset.from_dict({"prompt": texts}), hash_reward, workdir=workdir,
        group_size=p.group_size, completions=p.prompts_per_step * p.group_size,
        micro_batch_size=p.micro_batch_size, max_completion_tokens=p.completion_tokens,
        max_steps=warmup + measured, seed=p.seed, device=p.device,
        lora=(p.lora_r, p.lora_alpha) if p.lora_r else None,
        **trl.matched(aggregation="sequence", learning_rate=p.learning_rate, kl_coef=p.kl_coef),
        gradient_checkpointing=p.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=compute == "bfloat16", fp16=compute == "float16", disable_dropout=True,
        torch_compile=p.compile_training)
    times["built_s"] = _since_launch()
    clock, meter, seen, rows = StageClock(p.device), MemoryMeter(p.device), {}, []
    _time_trl(trainer, clock, meter, seen, torch)
    short = p.trl_warmup_completion_tokens if warmup else None
    restore = trl.generate_at_most(trainer, short) if short else lambda: None
    state = {}

    def step_done(seconds: float) -> None:
        s = clock.seconds()  # synchronises once, after the step
        times.setdefault("steps_end_s", []).append(_since_launch())
        s["loss_backward_s"] = (s.pop("training_step_s", 0.0) - s.pop("prepare_inputs_s", 0.0)
                                + s.pop("clip_s", 0.0))
        row = _step_row(seconds, s, seen)
        row.update(prefill_s=None, decode_s=None)
        rows.append(row)
        if len(rows) == warmup:
            restore()  # a short warm-up step ends: the measured steps generate in full
        if len(rows) > warmup:
            progress(snapshot(final=False))

    def optimizer_start() -> None:
        meter.phase("optimizer")
        state["optimizer"] = clock.start("optimizer_s")

    def optimizer_end() -> None:
        clock.stop(state.pop("optimizer"))
        meter.phase("training")

    def snapshot(final: bool) -> dict:  # the result so far: after each measured step, and at the end
        return {"rows": rows, "memory": meter.finish(final), "settings": trl.settings(trainer),
                "trainable_params": sum(x.numel() for x in trainer.model.parameters() if x.requires_grad),
                "times": times, "decoding": "transformers generate", "prompt_sharing_in_training": False,
                "warmup_completion_tokens": short}

    trainer.add_callback(trl.step_timer(step_done, begin=meter.start, before_optimizer=optimizer_start,
                                        after_optimizer=optimizer_end))
    trainer.train()
    return snapshot(final=True)


def _time_trl(trainer, clock: StageClock, meter: MemoryMeter, seen: dict, torch) -> None:
    """TRL's stages from wrappers on its own methods (module docstring)."""
    def record(out):  # _generate returns (prompt_ids, completion_ids, ...) as lists of id lists
        seen.update(_lengths([len(x) for x in out[0]], [len(x) for x in out[1]]))

    def sampling(fn):
        def wrapper(*args, **kwargs):
            meter.phase("sampling")
            out = fn(*args, **kwargs)
            meter.phase("training")
            return out
        return wrapper

    trainer._generate = sampling(clock.wrap("generation_s", trainer._generate, after=record))
    trainer._calculate_rewards = clock.wrap("reward_s", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = clock.wrap(
        "logprobs_s", trainer._get_per_token_logps_and_entropies, when=lambda: not torch.is_grad_enabled())
    trainer.training_step = clock.wrap("training_step_s", trainer.training_step)
    trainer._prepare_inputs = clock.wrap("prepare_inputs_s", trainer._prepare_inputs)
    # clipping runs after training_step; accelerate's public method, whichever transformers calls it
    trainer.accelerator.clip_grad_norm_ = clock.wrap("clip_s", trainer.accelerator.clip_grad_norm_)


def worker(engine: str, p: Preset) -> dict:
    """Runs one engine in this process; returns its measured steps, summary and settings. After each
    measured step it prints the result so far (``harness.emit_partial``): a worker killed at its time
    limit keeps the steps it measured."""
    def progress(raw: dict) -> None:
        harness.emit_partial(_summarize(engine, p, raw))

    with tempfile.TemporaryDirectory(prefix=f"perf-{engine}-") as workdir:
        raw = (run_ours if engine == "ours" else run_trl)(p, workdir, progress)
    return _summarize(engine, p, raw)


def _summarize(engine: str, p: Preset, raw: dict) -> dict:
    measured = raw["rows"][p.warmup_steps:]
    if not measured:
        raise SystemExit(f"{engine}: no measured step (ran {len(raw['rows'])}, warm-up {p.warmup_steps})")
    med = {k: harness.median(r.get(k) for r in measured)
           for k in ("step_s", *STAGES, "prefill_s", "decode_s")}
    generated = harness.median(r["generated_tokens"] for r in measured)
    return {
        "measured_steps": len(measured),
        "engine": engine, "hardware": harness.hardware(p.device),
        "step_s": med["step_s"], "step_s_min": min(r["step_s"] for r in measured),
        "stages": {k: med[k] for k in STAGES}, "prefill_s": med["prefill_s"], "decode_s": med["decode_s"],
        "first_step_s": raw["times"]["steps_end_s"][0], "times": raw["times"], "decoding": raw["decoding"],
        "decoding_fallback": raw.get("decoding_fallback"),
        "prompt_sharing_in_training": raw["prompt_sharing_in_training"],
        "warmup_completion_tokens": raw.get("warmup_completion_tokens"),
        "tokens_per_s": generated / med["generation_s"] if med["generation_s"] else None,
        "e2e_tokens_per_s": generated / med["step_s"], "generated_tokens_per_step": generated,
        # the lengths of the measured steps (a short warm-up generates fewer tokens)
        **{k: f(r[k] for r in measured) for k, f in (("prompt_tokens_min", min), ("prompt_tokens_max", max),
                                                     ("completion_tokens_min", min),
                                                     ("completion_tokens_max", max))},
        **raw["memory"], "trainable_params": raw["trainable_params"], "settings": raw["settings"],
        "steps": raw["rows"],
        **{k: raw[k] for k in ("predicted_peak_mib", "predicted_phases_mib") if k in raw},
    }


# -- the parent: alternate the engines, aggregate, compare -------------------------------------------


def floor(p: Preset) -> dict:
    """The physical-floor numbers of one step (see docs/benchmarks.md)."""
    s, c = SHAPES[p.shape], count_params(p.shape)
    head = s.vocab * s.hidden
    matmul = c["non_embedding"] + head  # the lm_head is a matmul; the embedding is a lookup
    n = p.prompts_per_step * p.group_size
    trained = n * (p.prompt_tokens + p.completion_tokens)
    compute = BYTES[p.compute_dtype or p.dtype]
    if p.quantization == "nf4":  # 4-bit trunk, the lm_head in the compute dtype
        weight_bytes = (c["non_embedding"] * NF4_BYTES + head * compute) / matmul
    else:  # under autocast the decode reads autocast's compute-dtype copies of the float32 weights
        weight_bytes = compute
    head_dim = s.hidden // s.heads
    return {
        "params": c["total"], "matmul_params": matmul, "trained_tokens_per_step": trained,
        "layers": s.layers, "q_dim": s.hidden, "generated_tokens_per_step": n * p.completion_tokens,
        "train_flops_per_step": 6 * matmul * trained,  # policy forward + backward, no recompute
        "decode_flops_per_step": 2 * matmul * n * p.completion_tokens,
        "decode_weight_bytes_per_param": weight_bytes,
        "decode_weight_bytes_per_token_step": matmul * weight_bytes,
        "kv_bytes_per_token": 2 * s.layers * s.kv_heads * head_dim * compute,
    }


def derived(p: Preset, fl: dict, result: dict, limits: dict) -> dict:
    """Decode's share of the HBM roofline and training MFU of one engine's result, against the measured
    ceilings and the card's data-sheet peaks (``limits``: :func:`_measure.ceilings`); on the CPU the
    rates without a fraction."""
    gpu = p.device == "cuda"
    n = p.prompts_per_step * p.group_size
    decode_s = result.get("decode_s") or result["stages"]["generation_s"]  # TRL: generation, prefill included
    lora_params = result["trainable_params"] if p.lora_r else 0
    roofline = decode_roofline(matmul_params=fl["matmul_params"],
                               weight_bytes=fl["decode_weight_bytes_per_param"],
                               lora_params=lora_params, rows=n, prompt_tokens=p.prompt_tokens,
                               completion_tokens=p.completion_tokens,
                               kv_bytes_per_token=fl["kv_bytes_per_token"],
                               decode_s=decode_s, hbm_bytes_per_s=limits["copy_bytes_per_s"])
    shared = result.get("prompt_sharing_in_training")
    trained = (p.prompts_per_step * p.prompt_tokens + n * p.completion_tokens if shared
               else n * (p.prompt_tokens + p.completion_tokens))
    mfu = training_mfu(matmul_params=fl["matmul_params"], layers=fl["layers"], q_dim=fl["q_dim"],
                       trained_tokens=trained, sequence_tokens=p.prompt_tokens + p.completion_tokens,
                       full=p.lora_r is None, checkpointing=p.gradient_checkpointing,
                       train_s=result["stages"]["loss_backward_s"], peak_flops=limits["matmul_flops"])
    achieved, rate = mfu["achieved_flops"], roofline["achieved_bytes_per_s"]
    spec_flops, spec_hbm = limits["spec_bf16_flops"], limits["spec_hbm_bytes_per_s"]
    return {"decode_time_s": decode_s, "decode_bytes_per_step": roofline["bytes_per_step"],
            "decode_bytes_per_s": rate,
            "decode_roofline_fraction": roofline["fraction"] if gpu else None,
            "decode_roofline_fraction_spec": rate / spec_hbm if gpu and rate and spec_hbm else None,
            "trained_tokens_per_step": trained, "train_flops_per_step": mfu["flops_per_step"],
            "train_tflops": achieved / 1e12 if achieved else None,
            "mfu": mfu["mfu"] if gpu else None,
            "mfu_spec": achieved / spec_flops if gpu and achieved and spec_flops else None}


def _aggregate(p: Preset, runs: list[dict], fl: dict, limits: dict) -> dict:
    med = lambda key: harness.median(r.get(key) for r in runs)  # None where no run has a value
    out = {"step_s": med("step_s"), "step_s_min": min(r["step_s_min"] for r in runs),
           "stages": {k: harness.median(r["stages"][k] for r in runs) for k in STAGES},
           "prefill_s": med("prefill_s"), "decode_s": med("decode_s"),
           "first_step_s": med("first_step_s"), "times": [r["times"] for r in runs],
           "decoding": runs[0]["decoding"],
           "warmup_completion_tokens": runs[0].get("warmup_completion_tokens"),
           "decoding_fallback": runs[0].get("decoding_fallback"),
           "prompt_sharing_in_training": runs[0]["prompt_sharing_in_training"],
           "generated_tokens_per_step": med("generated_tokens_per_step"),
           "peak_mib": med("peak_mib"), "peak_reserved_mib": med("peak_reserved_mib"),
           "baseline_mib": med("baseline_mib"), "phases_mib": runs[0]["phases_mib"],
           "peak_above_baseline_mib": med("peak_above_baseline_mib"), "peak_scope": runs[0]["peak_scope"],
           "trainable_params": runs[0]["trainable_params"], "settings": runs[0]["settings"],
           "completion_tokens": [min(r["completion_tokens_min"] for r in runs),
                                 max(r["completion_tokens_max"] for r in runs)],
           "prompt_tokens": [min(r["prompt_tokens_min"] for r in runs),
                             max(r["prompt_tokens_max"] for r in runs)],
           "step_s_runs": [r["step_s"] for r in runs], "peak_mib_runs": [r["peak_mib"] for r in runs],
           "measured_steps": sum(r["measured_steps"] for r in runs),
           "partial": any(r.get("partial") for r in runs)}  # a worker stopped before its last step
    if "predicted_peak_mib" in runs[0]:  # ours: the estimator's prediction (grpo_engine.memory.estimate)
        out["predicted_peak_mib"] = runs[0]["predicted_peak_mib"]
        out["predicted_phases_mib"] = runs[0]["predicted_phases_mib"]
        out["predicted_over_measured"] = runs[0]["predicted_peak_mib"] / out["peak_mib"]
    gen_s = out["stages"]["generation_s"]
    out["tokens_per_s"] = out["generated_tokens_per_step"] / gen_s if gen_s else None
    out["e2e_tokens_per_s"] = out["generated_tokens_per_step"] / out["step_s"]
    out.update(derived(p, fl, out, limits))
    return out


def _problems(p: Preset, results: dict) -> list[str]:
    problems = []
    for engine, res in results.items():
        if res is None:
            continue
        if res["completion_tokens"] != [p.completion_tokens, p.completion_tokens]:
            problems.append(f"{engine}: completions had {res['completion_tokens']} tokens, "
                            f"not {p.completion_tokens}")
        if res["prompt_tokens"] != [p.prompt_tokens, p.prompt_tokens]:
            problems.append(f"{engine}: prompts had {res['prompt_tokens']} tokens, not {p.prompt_tokens}")
    if results.get("ours") and results.get("trl"):
        a, b = results["ours"]["settings"], results["trl"]["settings"]
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                problems.append(f"setting {key}: ours {a.get(key)!r} != trl {b.get(key)!r}")
        if results["ours"]["trainable_params"] != results["trl"]["trainable_params"]:
            problems.append(f"trainable params: ours {results['ours']['trainable_params']} != "
                            f"trl {results['trl']['trainable_params']}")
    return problems


def _report(name: str, p: Preset, runs: dict[str, list[dict]], errors: list[str],
            preflight: Path | None) -> dict:
    # the workers name the device (the parent imports no torch); its data-sheet peaks follow from the name
    named = [r["hardware"] for rs in runs.values() for r in rs if r.get("hardware")]
    hardware = named[0] if named else harness.hardware("cpu") if p.device == "cpu" else None
    limits = ceilings(hardware if p.device == "cuda" else None, preflight)
    fl = floor(p)
    results = {e: _aggregate(p, r, fl, limits) if r else None for e, r in runs.items()}
    ours, theirs = results.get("ours"), results.get("trl")
    both = bool(ours and theirs)
    problems = _problems(p, results)
    return {
        "preset": name, "device": p.device, "hardware": hardware,
        "versions": harness.versions(), "commit": harness.git_commit(), "ceilings": limits,
        "spec": dataclasses.asdict(p), "floor": fl, "ours": ours, "trl": theirs,
        "ratio_step_time": ours["step_s"] / theirs["step_s"] if both else None,
        "ratio_peak_memory": ours["peak_mib"] / theirs["peak_mib"] if both else None,
        # TRL's plain generate() is its slowest path: the training part compared on its own
        "ratio_loss_backward": (ours["stages"]["loss_backward_s"] / theirs["stages"]["loss_backward_s"]
                                if both and theirs["stages"]["loss_backward_s"] else None),
        "ratio_peak_above_baseline": (ours["peak_above_baseline_mib"] / theirs["peak_above_baseline_mib"]
                                      if both and theirs["peak_above_baseline_mib"] > 0 else None),
        "ratio_generation_tokens_per_s": (
            ours["tokens_per_s"] / theirs["tokens_per_s"]
            if both and ours["tokens_per_s"] and theirs["tokens_per_s"] else None),
        "settings_match": not any(x.startswith(("setting", "trainable")) for x in problems) if both else None,
        "problems": problems, "errors": list(errors),
        "runs": {e: [{k: v for k, v in r.items() if k != "settings"} for r in rs] for e, rs in runs.items()},
    }


def worker_limit(p: Preset, engine: str) -> float:
    """One worker's fixed time limit."""
    return p.trl_timeout_s if engine == "trl" and p.trl_timeout_s else p.worker_timeout_s


def stage_limit(p: Preset, engines: tuple[str, ...]) -> int:
    """The seconds a run of ``engines`` needs at most: every worker's fixed limit, + 5 for this parent
    (it imports no torch). The GPU run's time plan adds these up (benchmarks/gpu/run.sh).

    Example:
        >>> stage_limit(PRESETS["gpu-0.5b"], ("ours", "trl"))
        160
    """
    return int(sum(worker_limit(p, e) for e in engines) * p.repetitions) + 5


def compare(name: str, p: Preset, engines: tuple[str, ...], out: Path | None, budget_s: float | None = None,
            deadline: float | None = None, log: Path | None = None, preflight: Path | None = None) -> dict:
    """Runs the alternating workers and returns the report (also written to ``out`` after each worker).

    Each worker has a fixed time limit (``worker_timeout_s``, TRL's ``trl_timeout_s``), cut to what
    is left before ``deadline`` (epoch seconds) or of ``budget_s``; a worker with under 10 s left is
    skipped and reported in ``errors``. ``preflight``: the GPU run's preflight.json, whose measured
    matrix-product rate and copy bandwidth are the ceilings of MFU and the roofline.
    """
    report = lambda: _report(name, p, runs, errors, preflight)  # noqa: E731
    ends = [x for x in (deadline, time.time() + budget_s if budget_s is not None else None) if x is not None]
    end = min(ends) if ends else None
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    errors: list[str] = []
    spec = json.dumps(dataclasses.asdict(p))
    # ours, trl, ours, trl, ...
    for rep, engine in harness.schedule(engines, range(p.repetitions), rotate=False):
        timeout = harness.time_limit(worker_limit(p, engine), end)
        if timeout is None:
            errors.append(f"{engine} repetition {rep + 1}: skipped, the time budget is spent")
            continue
        harness.say("perf", f"{name}: {engine} repetition {rep + 1}/{p.repetitions} (limit {timeout:.0f} s)")
        args = [str(Path(__file__).resolve()), "--worker", engine, "--spec", spec]
        result, error = harness.run_worker(engine, args, timeout, harness.worker_env(), log)
        if error:
            errors.append(error)
            harness.say("perf", error)
        if result is not None:  # with an error: the steps measured before it ("partial": true)
            runs[engine].append(result)
        if out is not None:
            harness.write_report(out, report())
    final = report()
    if out is not None:
        harness.write_report(out, final)
    return final


def _summary(r: dict) -> str:
    lines = [f"preset {r['preset']} on {r['hardware']}"]
    head = (f"{'':10}{'step s':>9}{'min s':>9}{'gen s':>9}{'logp s':>9}{'fwd+bwd s':>11}{'optim s':>9}"
            f"{'other s':>9}")
    lines.append(head + f"{'gen tok/s':>11}{'peak MiB':>10}{'+base MiB':>11}")
    for engine in ("ours", "trl"):
        e = r.get(engine)
        if not e:
            continue
        st = e["stages"]
        lines.append(f"{engine:10}{e['step_s']:9.2f}{e['step_s_min']:9.2f}{st['generation_s']:9.2f}"
                     f"{st['logprobs_s']:9.2f}{st['loss_backward_s']:11.2f}{st['optimizer_s']:9.2f}"
                     f"{st['other_s'] + st['reward_s']:9.2f}"
                     f"{e['tokens_per_s']:11.1f}{e['peak_mib']:10.0f}{e['peak_above_baseline_mib']:11.0f}")
    if r.get("ratio_step_time") is not None:
        lines.append(f"ours/trl: step time {r['ratio_step_time']:.2f}, "
                     f"loss + backward {r['ratio_loss_backward'] or float('nan'):.2f}, "
                     f"peak memory {r['ratio_peak_memory']:.2f}")
    lines += [f"PROBLEM: {x}" for x in r.get("problems", [])] + [f"ERROR: {x}" for x in r.get("errors", [])]
    return "\n".join(lines)


def _parse_override(text: str, p: Preset) -> Preset:
    key, _, value = text.partition("=")
    fields = {f.name: f for f in dataclasses.fields(Preset)}
    if key not in fields:
        raise SystemExit(f"--set {text!r}: unknown field {key!r}; fields: {', '.join(fields)}")
    current = getattr(p, key)
    if value.lower() in ("none", "null"):
        parsed = None
    elif isinstance(current, bool) or key == "gradient_checkpointing":
        parsed = value.lower() in ("1", "true", "yes", "on")
    elif isinstance(current, int) or key in ("lora_r", "threads"):
        parsed = int(value)
    elif isinstance(current, float):
        parsed = float(value)
    else:
        parsed = value
    return dataclasses.replace(p, **{key: parsed})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small")
    parser.add_argument("--repetitions", type=int, help="workers per engine (default: the preset's)")
    parser.add_argument("--steps", type=int, help="measured steps per worker (default: the preset's)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a preset field")
    parser.add_argument("--engines", default="ours,trl", help="comma-separated subset of ours,trl")
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    parser.add_argument("--budget-s", type=float,
                        help="stop starting workers once this many seconds have passed")
    parser.add_argument("--deadline", type=float, help="epoch seconds by which every worker must have ended")
    parser.add_argument("--smoke", action="store_true",
                        help="shrink the preset to a tiny CPU run (see smoke())")
    parser.add_argument("--log", type=Path, help="append each worker's stderr to this file")
    parser.add_argument("--preflight", type=Path,
                        help="the GPU run's preflight.json: its measured ceilings for MFU and the roofline")
    parser.add_argument("--stage-limit", action="store_true",
                        help="print the most seconds the run takes (its workers' limits + 5) and exit")
    parser.add_argument("--worker", choices=("ours", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        harness.emit(worker(args.worker, Preset(**json.loads(args.spec))))
        return 0
    p = PRESETS[args.preset]
    if args.smoke:
        p = smoke(p)
    if args.repetitions:
        p = dataclasses.replace(p, repetitions=args.repetitions)
    if args.steps:
        p = dataclasses.replace(p, measured_steps=args.steps)
    for text in args.set:
        p = _parse_override(text, p)
    engines = tuple(e.strip() for e in args.engines.split(",") if e.strip())
    if not set(engines) <= {"ours", "trl"} or not engines:
        raise SystemExit(f"--engines {args.engines!r}: use ours, trl or ours,trl")
    if args.stage_limit:
        print(stage_limit(p, engines))
        return 0
    report = compare(args.preset, p, engines, args.out, args.budget_s, args.deadline, args.log,
                     args.preflight)
    print(_summary(report), flush=True)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}), flush=True)
    return 1 if report["problems"] or report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
