"""TRL's side of every benchmark: its GRPOTrainer built from our settings, its steps timed, what it holds
read back. perf.py and learning.py both run TRL through these pieces, so the mapping of our names onto
TRL's and the record of what each engine holds are written once.

- :func:`matched`: the TRL arguments of our reference settings (group z-score with eps 1e-4, clip 0.2,
  no KL, constant lr, fused AdamW, clipping at 1.0, temperature 1 without top-p / top-k, one update
  per batch), with the aggregation spelled as TRL's ``loss_type``.
- :func:`build`: TRL's ``GRPOConfig`` and ``GRPOTrainer`` for one worker. The batch shape is ours:
  ``num_generations=G``, ``per_device_train_batch_size=m``, ``gradient_accumulation_steps=B*G/m``
  (TRL's ``steps_per_generation`` defaults to it), so one optimizer step consumes one generation of
  B*G completions. No logging, saving or tqdm; the CPU when asked; LoRA through peft's
  ``LoraConfig`` on every linear layer.
- :func:`step_timer`: a callback that hands each optimizer step's wall time to the benchmark.
- :func:`generate_at_most`: the next generations cut to a few tokens (a short warm-up step).
- :func:`settings` and :func:`ours_settings`: what each engine's trainer holds, in the same keys, so
  that a benchmark can require them equal.

Importing this module imports neither TRL nor torch (a benchmark's parent process does not need them).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import _harness as harness

# our aggregation names and TRL's loss_type for the same normalisation
LOSS_TYPE = {"sequence": "grpo", "token": "dapo", "constant": "dr_grpo"}
AGGREGATION = {v: k for k, v in LOSS_TYPE.items()}
ADVANTAGE_EPS = 1e-4  # TRL divides by the group's std + 1e-4


def matched(*, aggregation: str, learning_rate: float, temperature: float = 1.0, kl_coef: float = 0.0,
            clip_eps: float = 0.2, adam_betas: tuple[float, float] = (0.9, 0.99),
            max_grad_norm: float = 1.0) -> dict:
    """TRL ``GRPOConfig`` arguments for our reference settings (module docstring).

    Example:
        >>> matched(aggregation="token", learning_rate=1e-4)["loss_type"]
        'dapo'
    """
    return dict(loss_type=LOSS_TYPE[aggregation], beta=kl_coef, use_bias_correction_kl=False,
                epsilon=clip_eps, num_iterations=1, scale_rewards="group", temperature=temperature, top_p=1.0,
                top_k=0,
                learning_rate=learning_rate, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                adam_beta1=adam_betas[0], adam_beta2=adam_betas[1], adam_epsilon=1e-8,
                optim="adamw_torch_fused", max_grad_norm=max_grad_norm, mask_truncated_completions=False)


def build(model, tokenizer, dataset, reward: Callable, *, workdir: str, group_size: int, completions: int,
          micro_batch_size: int, max_completion_tokens: int, max_steps: int, seed: int, device: str,
          lora: tuple[int, float] | None = None, logging_steps: int = 10**6, **choices):
    """TRL's GRPOTrainer for one worker (module docstring); ``choices`` are further ``GRPOConfig``
    arguments (the benchmark's: :func:`matched`, precision, checkpointing, ...); ``lora`` is (r, alpha)."""
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    if completions % micro_batch_size:
        raise SystemExit(f"B*G={completions} must be a multiple of micro_batch_size={micro_batch_size} "
                         "for TRL")
    args = GRPOConfig(
        output_dir=workdir, num_generations=group_size, per_device_train_batch_size=micro_batch_size,
        gradient_accumulation_steps=completions // micro_batch_size,
        max_completion_length=max_completion_tokens,
        max_steps=max_steps, seed=seed, use_cpu=device == "cpu", report_to="none", save_strategy="no",
        logging_steps=logging_steps, disable_tqdm=True, log_completions=False, dataloader_num_workers=0,
        **choices)
    peft_config = None
    if lora is not None:
        peft_config = LoraConfig(r=lora[0], lora_alpha=lora[1], lora_dropout=0.0, target_modules="all-linear",
                                 task_type="CAUSAL_LM", bias="none")
    return GRPOTrainer(model, reward_funcs=reward, args=args, train_dataset=dataset,
                       processing_class=tokenizer, peft_config=peft_config)


def step_timer(step_done: Callable[[float], bool | None], *, begin: Callable[[], None] = lambda: None,
               before_optimizer: Callable[[], None] | None = None,
               after_optimizer: Callable[[], None] | None = None):
    """A TRL callback: ``step_done(seconds)`` at each optimizer step's end, with the wall time since the
    previous one ended (or training began); training stops when it returns True. What ``step_done``
    itself takes (an evaluation, a partial result) is not counted in the next step. ``begin`` runs when
    training starts; ``before_optimizer`` / ``after_optimizer`` around each optimizer step."""
    from transformers import TrainerCallback

    last = [0.0]

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            begin()
            last[0] = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if before_optimizer is not None:
                before_optimizer()

        def on_optimizer_step(self, args, state, control, **kwargs):
            if after_optimizer is not None:
                after_optimizer()

        def on_step_end(self, args, state, control, **kwargs):
            if step_done(time.perf_counter() - last[0]):
                control.should_training_stop = True
            last[0] = time.perf_counter()

    return StepTimer()


def generate_at_most(trainer, tokens: int) -> Callable[[], None]:
    """TRL's next generations stop after ``tokens`` new tokens (its transformers path); returns the call
    that restores its own limit. For a short warm-up step: the kernels, Triton's JIT and the allocator
    warm up without paying a full-length generation."""
    config, kwargs = getattr(trainer, "generation_config", None), getattr(trainer, "generation_kwargs", None)
    if config is None or not isinstance(kwargs, dict) or "max_new_tokens" not in kwargs:
        raise RuntimeError("TRL's GRPOTrainer has no generation_config / generation_kwargs['max_new_tokens'] "
                           "(its generation path moved); run without a short warm-up "
                           "(trl_warmup_completion_tokens=None)")
    full = config.max_new_tokens
    config.max_new_tokens = kwargs["max_new_tokens"] = tokens

    def restore() -> None:
        config.max_new_tokens = kwargs["max_new_tokens"] = full

    return restore


def _advantage(std_scope: str, eps: float) -> str:
    return harness.advantage_text(std_scope, eps)


def settings(trainer) -> dict:
    """What TRL's built trainer holds, in :func:`ours_settings`'s keys."""
    a = trainer.args
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
    weights = harness.weights_dtype(trainer.model)
    return {
        "prompts_per_step": a.generation_batch_size // a.num_generations, "group_size": a.num_generations,
        "completions_per_optimizer_step": a.per_device_train_batch_size * a.gradient_accumulation_steps,
        "generations_per_optimizer_step": a.gradient_accumulation_steps // a.steps_per_generation,
        "micro_batch_size": a.per_device_train_batch_size, "max_completion_tokens": a.max_completion_length,
        "lora": harness.lora_settings(getattr(trainer.model, "peft_config", {}).get("default")),
        "gradient_checkpointing": harness.checkpointing(trainer.model),
        "weights_dtype": weights,
        "compute_dtype": "bfloat16" if a.bf16 else "float16" if a.fp16 else weights,
        "kl_coef": a.beta,
        "clip_eps": [a.epsilon, a.epsilon_high if a.epsilon_high is not None else a.epsilon],
        "aggregation": AGGREGATION.get(a.loss_type, a.loss_type),
        "advantage": _advantage(a.scale_rewards if a.scale_rewards in ("group", "batch") else "none",
                                ADVANTAGE_EPS),
        "updates_per_batch": a.num_iterations, "learning_rate": a.learning_rate,
        "lr_schedule": getattr(a.lr_scheduler_type, "value", a.lr_scheduler_type),
        "warmup_steps": a.warmup_steps, "adam_betas": [a.adam_beta1, a.adam_beta2],
        "adam_eps": a.adam_epsilon,
        "weight_decay": a.weight_decay, "max_grad_norm": a.max_grad_norm, "temperature": a.temperature,
        "top_p": a.top_p, "top_k": a.top_k, "eos_ids": sorted(trainer.eos_token_ids),
        "compile_training": bool(a.torch_compile),
        "optimizer": f"{type(optimizer).__name__}(fused={optimizer.defaults.get('fused')})",
    }


def ours_settings(trainer) -> dict:
    """What our built ``GRPOTrainer`` holds, in :func:`settings`'s keys."""
    config, memory, loss, advantage = trainer.config, trainer.memory, trainer.loss, trainer.advantage
    weights = harness.weights_dtype(trainer.model)
    low = getattr(loss, "clip_eps_low", None)
    high = getattr(loss, "clip_eps_high", None)
    return {
        "prompts_per_step": config.prompts_per_step, "group_size": config.group_size,
        "completions_per_optimizer_step": config.completions_per_step, "generations_per_optimizer_step": 1,
        "micro_batch_size": min(memory.micro_batch_size, config.completions_per_step),
        "max_completion_tokens": config.max_completion_tokens,
        "lora": harness.lora_settings(getattr(trainer.model, "peft_config", {}).get("default")),
        "gradient_checkpointing": harness.checkpointing(trainer.model),
        "weights_dtype": weights,
        "compute_dtype": memory.compute_dtype if memory.mixed_precision else weights,
        "kl_coef": getattr(loss, "kl_coef", None), "clip_eps": [low, high if high is not None else low],
        "aggregation": getattr(loss, "aggregation", None),
        "advantage": _advantage(getattr(advantage, "std_scope", "none"), getattr(advantage, "eps", 0.0)),
        "updates_per_batch": config.updates_per_batch, "learning_rate": config.learning_rate,
        "lr_schedule": config.lr_schedule, "warmup_steps": config.warmup_steps,
        "adam_betas": list(config.adam_betas), "adam_eps": config.adam_eps,
        "weight_decay": config.weight_decay,
        "max_grad_norm": config.max_grad_norm, "temperature": config.temperature, "top_p": config.top_p,
        "top_k": config.top_k, "eos_ids": sorted(trainer.sampler.eos_ids),
        "compile_training": memory.compile_training,
        "optimizer": f"{type(trainer.optimizer).__name__}(fused={trainer.optimizer.defaults.get('fused')})",
    }
