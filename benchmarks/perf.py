"""GRPO step time, stage split, generation throughput and peak memory: grpo_engine against TRL.

Both engines train the same random-init model (built from the same seed) on the same prompts with
the same settings, each (engine, repetition) in a fresh process so that peak memory is its own:
ours, trl, ours, trl, ... The parent prints a summary, then one JSON object as its last line.

    python benchmarks/perf.py --preset cpu-small [--repetitions 2] [--set lora_r=16] [--out r.json]

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
  checkpointing (non-reentrant); dtype of the weights (no autocast on our side; TRL's bf16 flag on
  a model already in bf16); KL coefficient; PPO clip 0.2; per-sequence mean aggregation (ours
  ``ClippedSurrogate(aggregation="sequence")``, TRL ``loss_type="grpo"``); group z-score
  advantages; AdamW (torch, not fused) with the same lr, betas, eps, no weight decay, constant lr,
  gradient clipping at 1.0; temperature 1, no top-p / top-k; no vLLM; no logging or saving.
- The reward: a CRC of the completion text (``_models.hash_score``).

Stages. Ours come from the trainer's own timers (``time/sample_s`` ...) plus a wrapper around
``optimizer.step``. TRL's come from wrappers around its methods: ``_generate`` (generation),
``_calculate_rewards``, ``_get_per_token_logps_and_entropies`` under no_grad (log-prob passes),
``training_step`` minus ``_prepare_inputs`` plus ``_clip_grad_norm`` (loss + backward), and the
``on_pre_optimizer_step`` / ``on_optimizer_step`` callbacks (optimizer). ``other_s`` is the step
time not in any stage. A step is timed from the end of the previous one (TRL: between
``on_step_end`` callbacks), so it includes fetching the prompts.

Peak memory: on CPU the peak RSS of the training loop (``VmHWM`` after resetting it through
``/proc/self/clear_refs`` when training starts: the model, the imports and the trainer are in it,
a transient peak while building them is not); on GPU ``torch.cuda.max_memory_allocated`` over
the loop (weights included).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _path in (str(HERE), str(ROOT)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from _models import SHAPES, build_model, count_params, hash_score, make_prompts, word_tokenizer  # noqa: E402

RESULT_TAG = "PERF_RESULT "
STAGES = ("generation_s", "reward_s", "logprobs_s", "loss_backward_s", "optimizer_s", "other_s")


@dataclasses.dataclass(frozen=True)
class Preset:
    """One benchmark configuration; every field is applied identically to both engines."""

    shape: str  # a key of _models.SHAPES
    device: str = "cpu"  # "cpu" or "cuda"
    dtype: str = "float32"
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
    repetitions: int = 2
    worker_timeout_s: float = 600.0
    # torch CPU threads (None = every core). The CPU presets use 1: on a shared 2-core machine a second
    # busy process stalls a 2-thread OpenMP pool at every barrier (steps measured 5-10x slower).
    threads: int | None = None
    seed: int = 0


PRESETS: dict[str, Preset] = {
    "micro": Preset("micro", prompts_per_step=2, group_size=2, prompt_tokens=8, completion_tokens=8,
                    micro_batch_size=2, warmup_steps=1, measured_steps=2, repetitions=1, worker_timeout_s=300,
                    threads=1),
    "cpu-small": Preset("llama-small", prompts_per_step=2, group_size=4, prompt_tokens=32, completion_tokens=64,
                        micro_batch_size=4, warmup_steps=1, measured_steps=4, repetitions=2, threads=1),
    "cpu-logits": Preset("qwen2-logits", prompts_per_step=2, group_size=4, prompt_tokens=32, completion_tokens=64,
                         micro_batch_size=4, warmup_steps=1, measured_steps=3, repetitions=2, threads=1),
    "gpu-0.5b": Preset("qwen2.5-0.5b", device="cuda", dtype="bfloat16", prompts_per_step=8, group_size=8,
                       prompt_tokens=128, completion_tokens=512, micro_batch_size=16, learning_rate=1e-6,
                       warmup_steps=1, measured_steps=2, repetitions=1, worker_timeout_s=100),
    # the issue-5 workload under the plan `grpo-engine plan --model qwen2.5-1.5b --budget-gib 8` picks
    "gpu-1.5b-8gib": Preset("qwen2.5-1.5b", device="cuda", dtype="bfloat16", prompts_per_step=4, group_size=8,
                            prompt_tokens=128, completion_tokens=1024, micro_batch_size=8, lora_r=16,
                            lora_alpha=32.0, gradient_checkpointing=True, learning_rate=1e-5, warmup_steps=1,
                            measured_steps=1, repetitions=1, worker_timeout_s=140),
    # a 7B shape under QLoRA (ours only: --engines ours)
    "gpu-7b-qlora": Preset("qwen2.5-7b", device="cuda", dtype="bfloat16", prompts_per_step=4, group_size=8,
                           prompt_tokens=128, completion_tokens=1024, micro_batch_size=4, lora_r=16, lora_alpha=32.0,
                           gradient_checkpointing=True, quantization="nf4", learning_rate=1e-5, warmup_steps=1,
                           measured_steps=1, repetitions=1, worker_timeout_s=200),
    "gpu-1.5b": Preset("qwen2.5-1.5b", device="cuda", dtype="bfloat16", prompts_per_step=4, group_size=8,
                       prompt_tokens=128, completion_tokens=1024, micro_batch_size=8, lora_r=16, lora_alpha=32.0,
                       learning_rate=1e-5, warmup_steps=1, measured_steps=1, repetitions=1, worker_timeout_s=140),
}


# -- measuring --------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


class MemoryMeter:
    """Baseline and peak memory of the training loop (see the module docstring)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.scope = "training loop"

    @staticmethod
    def _status_kib(key: str) -> int | None:
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        except OSError:
            pass
        return None

    def start(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated()
            return
        self.setup_peak = self._status_kib("VmHWM")
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        except OSError:
            self.scope = "process"  # cannot reset: the peak is the whole process's
        self.baseline = (self._status_kib("VmRSS") or 0) * 1024

    def finish(self) -> dict:
        mib = 1024 * 1024
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            extra = {"peak_reserved_mib": torch.cuda.max_memory_reserved() / mib}
        else:
            import resource

            hwm = self._status_kib("VmHWM") if self.scope != "process" else None
            peak = hwm * 1024 if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            setup = getattr(self, "setup_peak", None)
            extra = {"setup_peak_mib": setup / 1024 if setup is not None else None}
        return {"peak_mib": peak / mib, "baseline_mib": self.baseline / mib,
                "peak_above_baseline_mib": (peak - self.baseline) / mib, "peak_scope": self.scope, **extra}


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


def _lora_settings(peft_config) -> dict | None:
    if peft_config is None:
        return None
    targets = peft_config.target_modules  # peft resolves "all-linear" to module names: keep their kinds
    targets = sorted({t.rsplit(".", 1)[-1] for t in targets}) if isinstance(targets, (set, list, tuple)) else targets
    return {"r": peft_config.r, "alpha": float(peft_config.lora_alpha), "dropout": peft_config.lora_dropout,
            "targets": targets}


def _checkpointing(model) -> bool:
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers 5.x, 4.x
        with contextlib.suppress(AttributeError):
            return bool(getattr(model, name))
    return False


def _weights_dtype(model) -> str:
    frozen = [p for p in model.parameters() if not p.requires_grad]
    return str((frozen or list(model.parameters()))[0].dtype).replace("torch.", "")


# -- the two workers ------------------------------------------------------------------------------


def run_ours(p: Preset, workdir: str) -> dict:
    from grpo_engine import ClippedSurrogate, GRPOConfig, GRPOTrainer, LoRA, MemoryPlan, Prompt, Reward
    from grpo_engine.advantages import GroupNormalized
    from grpo_engine.data.templates import PlainTemplate

    class HashReward(Reward):
        def score(self, prompt, completion):
            return hash_score(completion)

    model, tokenizer, texts = _setup(p)
    config = GRPOConfig(
        prompts_per_step=p.prompts_per_step, group_size=p.group_size, max_prompt_tokens=p.prompt_tokens,
        max_completion_tokens=p.completion_tokens, max_steps=p.warmup_steps + p.measured_steps, temperature=1.0,
        top_p=1.0, top_k=0, learning_rate=p.learning_rate, lr_schedule="constant", warmup_steps=0, weight_decay=0.0,
        adam_betas=(0.9, 0.99), adam_eps=1e-8, max_grad_norm=1.0, seed=p.seed, output_dir=workdir,
        progress_bar=False,
    )
    lora = LoRA(r=p.lora_r, alpha=p.lora_alpha, dropout=0.0, target_modules="all-linear") if p.lora_r else None
    memory = MemoryPlan(lora=lora, gradient_checkpointing=p.gradient_checkpointing, quantization=p.quantization,
                        micro_batch_size=p.micro_batch_size, dtype=p.dtype)
    from grpo_engine.memory.estimate import Workload, estimate_memory

    predicted = estimate_memory(model.config, memory, Workload(
        prompts_per_step=p.prompts_per_step, group_size=p.group_size, prompt_tokens=p.prompt_tokens,
        completion_tokens=p.completion_tokens, kl=p.kl_coef > 0))
    loss = ClippedSurrogate(clip_eps_low=0.2, kl_coef=p.kl_coef, aggregation="sequence")
    trainer = GRPOTrainer(model, [HashReward()], [Prompt(t) for t in texts], config, memory, tokenizer=tokenizer,
                          advantage=GroupNormalized(), loss=loss, template=PlainTemplate("{question}"))

    optimizer_s = [0.0]
    optimizer_step = trainer.optimizer.step

    def timed_optimizer_step(*args, **kwargs):
        _sync(p.device)
        start = time.perf_counter()
        out = optimizer_step(*args, **kwargs)
        _sync(p.device)
        optimizer_s[0] += time.perf_counter() - start
        return out

    trainer.optimizer.step = timed_optimizer_step
    seen: dict = {}
    sample = trainer.sampler.sample

    def recorded_sample(prompts, *, group_size):
        batch = sample(prompts, group_size=group_size)
        seen.update(_lengths(batch.prompt_mask.sum(1).tolist(), batch.completion_lengths.tolist()))
        return batch

    trainer.sampler.sample = recorded_sample
    meter, rows = MemoryMeter(p.device), []
    meter.start()
    for _ in range(p.warmup_steps + p.measured_steps):
        optimizer_s[0] = 0.0
        _sync(p.device)
        start = time.perf_counter()
        m = trainer.step()
        _sync(p.device)
        step_s = time.perf_counter() - start
        stages = {"generation_s": m["time/sample_s"], "reward_s": m["time/reward_s"],
                  "logprobs_s": m["time/logprobs_s"], "optimizer_s": optimizer_s[0],
                  "loss_backward_s": m["time/train_s"] - optimizer_s[0]}
        rows.append(_step_row(step_s, stages, seen))
    settings = {
        "prompts_per_step": config.prompts_per_step, "group_size": config.group_size,
        "completions_per_optimizer_step": config.completions_per_step, "generations_per_optimizer_step": 1,
        "micro_batch_size": memory.micro_batch_size, "max_completion_tokens": config.max_completion_tokens,
        "lora": _lora_settings(getattr(trainer.model, "peft_config", {}).get("default")),
        "gradient_checkpointing": _checkpointing(trainer.model),
        "weights_dtype": _weights_dtype(trainer.model), "kl_coef": loss.kl_coef, "clip_eps": loss.clip_eps_low,
        "aggregation": "sequence", "learning_rate": config.learning_rate, "adam_betas": list(config.adam_betas),
        "max_grad_norm": config.max_grad_norm, "temperature": config.temperature,
        "optimizer": f"{type(trainer.optimizer).__name__}(fused={trainer.optimizer.defaults.get('fused')})",
    }
    trainable = sum(x.numel() for x in trainer.model.parameters() if x.requires_grad)
    return {"rows": rows, "memory": meter.finish(), "settings": settings, "trainable_params": trainable,
            "predicted_peak_mib": predicted.peak_bytes / 2**20, "predicted_phases_mib":
            {k: v / 2**20 for k, v in predicted.phases.items()}}


def run_trl(p: Preset, workdir: str) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    model, tokenizer, texts = _setup(p)
    completions = p.prompts_per_step * p.group_size
    if completions % p.micro_batch_size:
        raise SystemExit(f"B*G={completions} must be a multiple of micro_batch_size={p.micro_batch_size} for TRL")
    if p.kl_coef and not p.lora_r:  # TRL builds a full-FT reference model from a path: give it one
        model.save_pretrained(f"{workdir}/policy")
        model.config._name_or_path = f"{workdir}/policy"
    args = TRLConfig(
        output_dir=workdir, per_device_train_batch_size=p.micro_batch_size,
        gradient_accumulation_steps=completions // p.micro_batch_size, num_generations=p.group_size,
        max_completion_length=p.completion_tokens, max_steps=p.warmup_steps + p.measured_steps,
        learning_rate=p.learning_rate, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.99, adam_epsilon=1e-8, max_grad_norm=1.0, optim="adamw_torch",
        beta=p.kl_coef, use_bias_correction_kl=False, loss_type="grpo", scale_rewards="group", epsilon=0.2,
        num_iterations=1, temperature=1.0, top_p=1.0, top_k=0, gradient_checkpointing=p.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False}, bf16=p.dtype == "bfloat16", fp16=False,
        use_cpu=p.device == "cpu", disable_dropout=True, report_to="none", save_strategy="no",
        logging_steps=10**6, disable_tqdm=True, seed=p.seed, dataloader_num_workers=0, log_completions=False,
    )
    peft_config = None
    if p.lora_r:
        peft_config = LoraConfig(r=p.lora_r, lora_alpha=p.lora_alpha, lora_dropout=0.0, target_modules="all-linear",
                                 task_type="CAUSAL_LM", bias="none")

    def hash_reward(completions, **kwargs):
        return [hash_score(c) for c in completions]

    trainer = TRLTrainer(model, reward_funcs=hash_reward, args=args, train_dataset=Dataset.from_dict({"prompt": texts}),
                         processing_class=tokenizer, peft_config=peft_config)

    stages: dict[str, float] = {}
    seen: dict = {}

    def timed(name, fn, *, when=lambda: True, after=None):
        def wrapper(*args, **kwargs):
            if not when():
                return fn(*args, **kwargs)
            _sync(p.device)
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            _sync(p.device)
            stages[name] = stages.get(name, 0.0) + time.perf_counter() - start
            if after is not None:
                after(out)
            return out
        return wrapper

    def record(out):  # _generate returns (prompt_ids, completion_ids, ...) as lists of id lists
        seen.update(_lengths([len(x) for x in out[0]], [len(x) for x in out[1]]))

    trainer._generate = timed("generation_s", trainer._generate, after=record)
    trainer._calculate_rewards = timed("reward_s", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed(
        "logprobs_s", trainer._get_per_token_logps_and_entropies, when=lambda: not torch.is_grad_enabled())
    trainer.training_step = timed("training_step_s", trainer.training_step)
    trainer._prepare_inputs = timed("prepare_inputs_s", trainer._prepare_inputs)
    trainer._clip_grad_norm = timed("clip_s", trainer._clip_grad_norm)
    meter, rows, clock = MemoryMeter(p.device), [], {}

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            meter.start()
            clock["last"] = time.perf_counter()

        def on_pre_optimizer_step(self, *a, **k):
            _sync(p.device)
            clock["optimizer"] = time.perf_counter()

        def on_optimizer_step(self, *a, **k):
            _sync(p.device)
            stages["optimizer_s"] = time.perf_counter() - clock["optimizer"]

        def on_step_end(self, *a, **k):
            _sync(p.device)
            now = time.perf_counter()
            s = dict(stages)
            s["loss_backward_s"] = (s.pop("training_step_s", 0.0) - s.pop("prepare_inputs_s", 0.0)
                                    + s.pop("clip_s", 0.0))
            rows.append(_step_row(now - clock["last"], s, seen))
            clock["last"] = now
            stages.clear()

    trainer.add_callback(Clock())
    trainer.train()
    memory = meter.finish()
    a = trainer.args
    settings = {
        "prompts_per_step": a.generation_batch_size // a.num_generations, "group_size": a.num_generations,
        "completions_per_optimizer_step": a.per_device_train_batch_size * a.gradient_accumulation_steps,
        "generations_per_optimizer_step": a.gradient_accumulation_steps // a.steps_per_generation,
        "micro_batch_size": a.per_device_train_batch_size, "max_completion_tokens": a.max_completion_length,
        "lora": _lora_settings(getattr(trainer.model, "peft_config", {}).get("default")),
        "gradient_checkpointing": _checkpointing(trainer.model),
        "weights_dtype": _weights_dtype(trainer.model), "kl_coef": a.beta, "clip_eps": a.epsilon,
        "aggregation": {"grpo": "sequence", "dapo": "token", "dr_grpo": "constant"}.get(a.loss_type, a.loss_type),
        "learning_rate": a.learning_rate, "adam_betas": [a.adam_beta1, a.adam_beta2],
        "max_grad_norm": a.max_grad_norm, "temperature": a.temperature,
        "optimizer": f"{type(trainer.optimizer.optimizer).__name__}"
                     f"(fused={trainer.optimizer.optimizer.defaults.get('fused')})",
    }
    trainable = sum(x.numel() for x in trainer.model.parameters() if x.requires_grad)
    return {"rows": rows, "memory": memory, "settings": settings, "trainable_params": trainable}


def worker(engine: str, p: Preset) -> dict:
    """Runs one engine in this process; returns its measured steps, summary and settings."""
    with tempfile.TemporaryDirectory(prefix=f"perf-{engine}-") as workdir:
        raw = (run_ours if engine == "ours" else run_trl)(p, workdir)
    measured = raw["rows"][p.warmup_steps:]
    if not measured:
        raise SystemExit(f"{engine}: no measured step (ran {len(raw['rows'])}, warm-up {p.warmup_steps})")
    med = {k: statistics.median(r[k] for r in measured) for k in ("step_s", *STAGES)}
    generated = statistics.median(r["generated_tokens"] for r in measured)
    return {
        "engine": engine, "step_s": med["step_s"], "step_s_min": min(r["step_s"] for r in measured),
        "stages": {k: med[k] for k in STAGES},
        "tokens_per_s": generated / med["generation_s"] if med["generation_s"] else None,
        "e2e_tokens_per_s": generated / med["step_s"], "generated_tokens_per_step": generated,
        **{k: f(r[k] for r in raw["rows"]) for k, f in (("prompt_tokens_min", min), ("prompt_tokens_max", max),
                                                         ("completion_tokens_min", min),
                                                         ("completion_tokens_max", max))},
        **raw["memory"], "trainable_params": raw["trainable_params"], "settings": raw["settings"], "steps": raw["rows"],
        **{k: raw[k] for k in ("predicted_peak_mib", "predicted_phases_mib") if k in raw},
    }


# -- the parent: alternate the engines, aggregate, compare -------------------------------------------


def _versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "trl", "accelerate"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def _hardware(device: str) -> str:
    if device == "cuda":
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name()} (1 GPU)"
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {os.cpu_count()} logical cores"


def floor(p: Preset) -> dict:
    """The physical-floor numbers of one step (see docs/benchmarks.md)."""
    s, c = SHAPES[p.shape], count_params(p.shape)
    matmul = c["non_embedding"] + s.vocab * s.hidden  # the lm_head is a matmul; the embedding is a lookup
    n = p.prompts_per_step * p.group_size
    trained = n * (p.prompt_tokens + p.completion_tokens)
    width = {"float32": 4, "bfloat16": 2, "float16": 2}[p.dtype]
    head_dim = s.hidden // s.heads
    return {
        "params": c["total"], "matmul_params": matmul, "trained_tokens_per_step": trained,
        "generated_tokens_per_step": n * p.completion_tokens,
        "train_flops_per_step": 6 * matmul * trained,  # policy forward + backward, no recompute
        "decode_flops_per_step": 2 * matmul * n * p.completion_tokens,
        "decode_weight_bytes_per_token_step": matmul * width,
        "kv_bytes_per_token": 2 * s.layers * s.kv_heads * head_dim * width,
    }


def _aggregate(runs: list[dict], fl: dict) -> dict:
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    out = {"step_s": med("step_s"), "step_s_min": min(r["step_s_min"] for r in runs),
           "stages": {k: statistics.median(r["stages"][k] for r in runs) for k in STAGES},
           "generated_tokens_per_step": med("generated_tokens_per_step"),
           "peak_mib": med("peak_mib"), "baseline_mib": med("baseline_mib"),
           "peak_above_baseline_mib": med("peak_above_baseline_mib"), "peak_scope": runs[0]["peak_scope"],
           "trainable_params": runs[0]["trainable_params"], "settings": runs[0]["settings"],
           "completion_tokens": [min(r["completion_tokens_min"] for r in runs),
                                 max(r["completion_tokens_max"] for r in runs)],
           "prompt_tokens": [min(r["prompt_tokens_min"] for r in runs), max(r["prompt_tokens_max"] for r in runs)],
           "step_s_runs": [r["step_s"] for r in runs], "peak_mib_runs": [r["peak_mib"] for r in runs]}
    if "predicted_peak_mib" in runs[0]:  # ours: the estimator's prediction (grpo_engine.memory.estimate)
        out["predicted_peak_mib"] = runs[0]["predicted_peak_mib"]
        out["predicted_phases_mib"] = runs[0]["predicted_phases_mib"]
        out["predicted_over_measured"] = runs[0]["predicted_peak_mib"] / out["peak_mib"]
    gen_s = out["stages"]["generation_s"]
    out["tokens_per_s"] = out["generated_tokens_per_step"] / gen_s if gen_s else None
    out["e2e_tokens_per_s"] = out["generated_tokens_per_step"] / out["step_s"]
    train_s = out["stages"]["loss_backward_s"]
    out["train_tflops"] = fl["train_flops_per_step"] / train_s / 1e12 if train_s else None
    completion_tokens = out["completion_tokens"][1]
    out["decode_weight_gbps"] = (fl["decode_weight_bytes_per_token_step"] * completion_tokens / gen_s / 1e9
                                 if gen_s else None)
    return out


def _problems(p: Preset, results: dict) -> list[str]:
    problems = []
    for engine, res in results.items():
        if res is None:
            continue
        if res["completion_tokens"] != [p.completion_tokens, p.completion_tokens]:
            problems.append(f"{engine}: completions had {res['completion_tokens']} tokens, not {p.completion_tokens}")
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


def _run_worker(engine: str, p: Preset, timeout: float) -> tuple[dict | None, str | None]:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1"}
    spec = json.dumps(dataclasses.asdict(p))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", engine, "--spec", spec]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, f"{engine}: worker timed out after {timeout:.0f} s"
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):]), None
    tail = (proc.stderr or proc.stdout)[-3000:]
    return None, f"{engine}: worker failed (exit {proc.returncode}):\n{tail}"


def _report(name: str, p: Preset, runs: dict[str, list[dict]], errors: list[str]) -> dict:
    fl = floor(p)
    results = {e: _aggregate(r, fl) if r else None for e, r in runs.items()}
    ours, trl = results.get("ours"), results.get("trl")
    both = bool(ours and trl)
    problems = _problems(p, results)
    return {
        "preset": name, "device": p.device, "hardware": _hardware(p.device), "versions": _versions(),
        "spec": dataclasses.asdict(p), "floor": fl, "ours": ours, "trl": trl,
        "ratio_step_time": ours["step_s"] / trl["step_s"] if both else None,
        "ratio_peak_memory": ours["peak_mib"] / trl["peak_mib"] if both else None,
        "ratio_peak_above_baseline": (ours["peak_above_baseline_mib"] / trl["peak_above_baseline_mib"]
                                      if both and trl["peak_above_baseline_mib"] > 0 else None),
        "ratio_generation_tokens_per_s": (ours["tokens_per_s"] / trl["tokens_per_s"]
                                          if both and ours["tokens_per_s"] and trl["tokens_per_s"] else None),
        "settings_match": not any(x.startswith(("setting", "trainable")) for x in problems) if both else None,
        "problems": problems, "errors": list(errors),
        "runs": {e: [{k: v for k, v in r.items() if k != "settings"} for r in rs] for e, rs in runs.items()},
    }


def compare(name: str, p: Preset, engines: tuple[str, ...], out: Path | None, budget_s: float | None) -> dict:
    """Runs the alternating workers and returns the report (also written to ``out`` after each worker)."""
    start = time.perf_counter()
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    errors: list[str] = []
    order = [(rep, engine) for rep in range(p.repetitions) for engine in engines]  # ours, trl, ours, trl, ...
    for index, (rep, engine) in enumerate(order):
        timeout = p.worker_timeout_s
        if budget_s is not None:  # an equal share of what is left for each worker still to run
            timeout = min(timeout, (budget_s - (time.perf_counter() - start)) / (len(order) - index))
            if timeout < 10:
                errors.append(f"{engine} repetition {rep + 1}: skipped, the time budget is spent")
                continue
        print(f"[perf] {name}: {engine} repetition {rep + 1}/{p.repetitions}", file=sys.stderr, flush=True)
        result, error = _run_worker(engine, p, timeout)
        if error:
            errors.append(error)
            print(f"[perf] {error}", file=sys.stderr, flush=True)
        else:
            runs[engine].append(result)
        if out is not None:
            out.write_text(json.dumps(_report(name, p, runs, errors), indent=1))
    report = _report(name, p, runs, errors)
    if out is not None:
        out.write_text(json.dumps(report, indent=1))
    return report


def _summary(r: dict) -> str:
    lines = [f"preset {r['preset']} on {r['hardware']}"]
    head = f"{'':10}{'step s':>9}{'min s':>9}{'gen s':>9}{'logp s':>9}{'fwd+bwd s':>11}{'optim s':>9}{'other s':>9}"
    lines.append(head + f"{'gen tok/s':>11}{'peak MiB':>10}{'+base MiB':>11}")
    for engine in ("ours", "trl"):
        e = r.get(engine)
        if not e:
            continue
        st = e["stages"]
        lines.append(f"{engine:10}{e['step_s']:9.2f}{e['step_s_min']:9.2f}{st['generation_s']:9.2f}{st['logprobs_s']:9.2f}"
                     f"{st['loss_backward_s']:11.2f}{st['optimizer_s']:9.2f}{st['other_s'] + st['reward_s']:9.2f}"
                     f"{e['tokens_per_s']:11.1f}{e['peak_mib']:10.0f}{e['peak_above_baseline_mib']:11.0f}")
    if r.get("ratio_step_time") is not None:
        lines.append(f"ours/trl: step time {r['ratio_step_time']:.2f}, peak memory {r['ratio_peak_memory']:.2f}")
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
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a preset field")
    parser.add_argument("--engines", default="ours,trl", help="comma-separated subset of ours,trl")
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    parser.add_argument("--budget-s", type=float, help="stop starting workers once this many seconds have passed")
    parser.add_argument("--worker", choices=("ours", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = worker(args.worker, Preset(**json.loads(args.spec)))
        print(RESULT_TAG + json.dumps(result), flush=True)
        return 0
    p = PRESETS[args.preset]
    if args.repetitions:
        p = dataclasses.replace(p, repetitions=args.repetitions)
    if args.steps:
        p = dataclasses.replace(p, measured_steps=args.steps)
    for text in args.set:
        p = _parse_override(text, p)
    engines = tuple(e.strip() for e in args.engines.split(",") if e.strip())
    if not set(engines) <= {"ours", "trl"} or not engines:
        raise SystemExit(f"--engines {args.engines!r}: use ours, trl or ours,trl")
    report = compare(args.preset, p, engines, args.out, args.budget_s)
    print(_summary(report), flush=True)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}), flush=True)
    return 1 if report["problems"] or report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
