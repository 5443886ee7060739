"""Variants of the demo recipe at a fixed step budget: held-out accuracy every N steps.

The evidence behind the demo's defaults (docs/benchmarks.md, "The recipe choices"; every sweep in
docs/lab/recipe-experiments.md). Each variant changes fields of ``grpo_engine.demo.DemoSettings`` and
trains our engine alone from the base model on the demo task; greedy held-out accuracy (the demo's 24
new tokens) is measured every ``--eval-every`` steps. A step budget, not a time budget, so that a
shared machine does not change what is measured.

Keys a variant may hold besides ``DemoSettings`` fields: ``config`` (a dict of ``GRPOConfig``
fields that win over the recipe's, e.g. ``{"seed": 1}`` for another sampling seed on the same
split), ``dynamic_sampling`` (a dict of ``DynamicSampling`` arguments, e.g.
``{"max_rounds": 2}``: train only on groups with unequal rewards, sampling again to fill the
batch), ``advantage`` (the name of a class in ``grpo_engine.advantages`` and its arguments, e.g.
``{"name": "GroupNormalized", "std_scope": "none"}``) and ``loss`` (``ClippedSurrogate``
arguments, e.g. ``{"aggregation": "token"}``, or another loss of ``grpo_engine.losses`` by name, e.g.
``{"name": "SAPO"}``); both win over the recipe's ``advantage_std_scope`` and ``loss_aggregation``.
A ``lora_r`` of 0 trains every weight (no adapter). The recipe's ``train_seconds`` does not apply (a
step budget; a ``linear`` / ``cosine`` ``lr_schedule`` decays
over ``--steps``, from the peak the demo takes when it plans ``--steps`` steps: ``learning_rate``,
or with a variant's ``lr_reference_steps`` and ``max_learning_rate`` the raised peak of a shorter plan).

``--eval-problems N`` evaluates on the first N problems of a test split drawn with the same seed;
its first ``num_test`` (256) problems are exactly the demo's held-out set (``arithmetic_task``
draws without replacement in a fixed order), so each curve point reports both: ``accuracy`` on
all N and ``demo_split`` on the demo's 256, then ``[correct, total]`` per kind of problem
(``+``, ``-`` with a result >= 0, ``-`` with a negative result). With 64 problems one run's binomial
standard error is ~6 points; 256 problems (the demo's since 2026-12-04) halve it.

    python benchmarks/recipe_sweep.py --steps 80 --eval-every 20 --eval-problems 256 \\
        --variant '{}' --variant '{"temperature": 0.8}' --variant '{"lr_schedule": "linear"}'

The last stdout line is one JSON object: ``{variant label: {"curve": [[step, accuracy,
demo_split, by_kind], ...], "truncated": [[step, mean truncated_fraction of the steps since the last
point], ...], "loss_metrics": {each metric the loss logs (clip or mask fractions): its mean over the
last 10 steps}, "step_s": median step seconds, "sample_s": ..., "train_s": ...}}``; with
``--eval-at-training-length`` also ``"curve_training_length": [[step, accuracy], ...]``, greedy at
``max_completion_tokens`` (a policy that runs on past its answer is right there and wrong at 24).
The rewards are the recipe's (``grpo_engine.demo.recipe_rewards``: ``{"finished_only": false}`` grades
truncated completions too), and its warm-up (``calibration_steps``) is kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile

import _harness as harness

# variant keys that are not DemoSettings fields
COMPONENT_KEYS = ("config", "dynamic_sampling", "advantage", "loss")


def build_advantage(spec: dict):
    """The advantage function a variant names: ``{"name": class in grpo_engine.advantages, **arguments}``."""
    from grpo_engine import advantages

    arguments = dict(spec)
    name = arguments.pop("name", None)
    if name not in advantages.__all__ or not isinstance(getattr(advantages, name), type):
        choices = [n for n in advantages.__all__ if isinstance(getattr(advantages, n), type)]
        raise ValueError(f"advantage name {name!r} is not a class of grpo_engine.advantages; "
                         f"use one of {choices}, "
                         'e.g. {"name": "GroupNormalized", "std_scope": "none"}')
    return getattr(advantages, name)(**arguments)


def build_loss(spec: dict):
    """The loss a variant names: ``{"name": class in grpo_engine.losses, **arguments}``, or without a name
    ``ClippedSurrogate(**spec)``."""
    from grpo_engine import losses

    arguments = dict(spec)
    name = arguments.pop("name", "ClippedSurrogate")
    classes = [n for n in losses.__all__ if isinstance(getattr(losses, n), type) and hasattr(
        getattr(losses, n), "counts")]
    if name not in classes:
        raise ValueError(f"loss name {name!r} is not a loss of grpo_engine.losses; use one of {classes}, "
                         'e.g. {"name": "SAPO"}')
    return getattr(losses, name)(**arguments)


def run_variant(variant: dict, *, steps: int, eval_every: int, model: str | None, threads: int | None,
                eval_problems: int | None = None, at_training_length: bool = False) -> dict:
    """Trains the demo recipe with ``variant`` applied; returns its accuracy curve and step times."""
    import torch

    from grpo_engine import GRPOConfig, GRPOTrainer, LoRA, MemoryPlan
    from grpo_engine.data import ChatTemplate
    from grpo_engine.demo import DemoSettings, demo_task, recipe_components, recipe_rewards, smollm2_folder
    from grpo_engine.eval import greedy_accuracy
    from grpo_engine.models import load_model
    from grpo_engine.rewards import MathAccuracy
    from grpo_engine.sampling import DynamicSampling

    if threads:
        torch.set_num_threads(threads)
    s = dataclasses.replace(DemoSettings(), **{k: v for k, v in variant.items() if k not in COMPONENT_KEYS})
    dynamic = DynamicSampling(**variant["dynamic_sampling"]) if "dynamic_sampling" in variant else None
    parts = recipe_components(s)
    advantage, loss = parts["advantage"], parts["loss"]
    if "advantage" in variant:
        advantage = build_advantage(variant["advantage"])
    if "loss" in variant:
        loss = build_loss(variant["loss"])
    torch.manual_seed(s.seed)
    policy, tokenizer = load_model(model or smollm2_folder())
    train, test = demo_task(dataclasses.replace(s, num_test=max(s.num_test, eval_problems or 0)))
    template, reward = ChatTemplate(instruction=s.instruction), MathAccuracy()
    rewards = recipe_rewards(s, reward)  # the training rewards; held-out accuracy is the reward itself
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(**{
            "prompts_per_step": s.prompts_per_step, "group_size": s.group_size, "max_prompt_tokens": 128,
            "max_completion_tokens": s.max_completion_tokens, "max_steps": steps,
            "warmup_steps": s.calibration_steps,
            "temperature": s.temperature,
            "learning_rate": s.learning_rate, "lr_schedule": s.lr_schedule, "seed": s.seed, "output_dir": out,
            "lr_reference_steps": s.lr_reference_steps, "max_learning_rate": s.max_learning_rate,
            "progress_bar": False, **variant.get("config", {})})
        lora = LoRA(r=s.lora_r, alpha=2 * s.lora_r) if s.lora_r else None
        memory = MemoryPlan(lora=lora, micro_batch_size=s.micro_batch_size,
                            merge_lora_for_sampling=s.merge_lora_for_sampling and lora is not None)
        trainer = GRPOTrainer(policy, rewards, train, config=config, memory=memory, tokenizer=tokenizer,
                              template=template, sampler=dynamic, advantage=advantage, loss=loss)
        curve, truncated, short = [], [], []
        for step in range(1, steps + 1):
            trainer.step()
            if step % eval_every == 0 or step == steps:
                since = truncated[-1][0] if truncated else 0
                window = [m["truncated_fraction"] for m in trainer.history[since:]]
                truncated.append([step, sum(window) / len(window)])
                if at_training_length:
                    cut = greedy_accuracy(trainer.model, tokenizer, test, reward, template=template,
                                          max_new_tokens=s.max_completion_tokens, batch_size=64)
                    short.append([step, cut.accuracy])
                scores = greedy_accuracy(trainer.model, tokenizer, test, reward, template=template,
                                         max_new_tokens=s.eval_max_new_tokens, batch_size=64).scores
                correct = [score >= 1.0 for score in scores]
                point = [step, sum(correct) / len(correct), sum(correct[:s.num_test]) / s.num_test,
                         accuracy_by_kind(test, correct)]
                curve.append(point)
                print(f"[sweep] {json.dumps(variant)} step {step}: {point[1]:.4f} "
                      f"(demo split {point[2]:.4f}; {json.dumps(point[3])})", flush=True)

    def median(key: str) -> float | None:
        return harness.median(m[key] for m in trainer.history)

    last = trainer.history[-10:]
    loss_metrics = {key: sum(m.get(key, 0.0) for m in last) / len(last)
                    for key in trainer.state.loss_metric_keys if key != "loss"}
    return {"curve": curve, "truncated": truncated, "loss_metrics": loss_metrics,
            "step_s": median("time/step_s"), "sample_s": median("time/sample_s"),
            "train_s": median("time/train_s"),
            **({"curve_training_length": short} if at_training_length else {})}


def accuracy_by_kind(problems: list, correct: list[bool]) -> dict[str, list[int]]:
    """``{kind: [correct, total]}`` with kinds ``"+"``, ``"- (result >= 0)"`` and ``"- (result < 0)"``
    (the comparison task's: ``"largest"`` and ``"smallest"``)."""
    counts: dict[str, list[int]] = {}
    for problem, ok in zip(problems, correct):
        op = problem.metadata.get("op")
        kind = problem.metadata.get("kind", op) if op != "-" else (
            "- (result < 0)" if int(problem.target) < 0 else "- (result >= 0)")
        entry = counts.setdefault(kind, [0, 0])
        entry[0] += ok
        entry[1] += 1
    return dict(sorted(counts.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", default=[], help="JSON: DemoSettings fields, config, "
                        "dynamic_sampling, advantage and/or loss to change (repeatable; default: "
                        "the shipped recipe only)")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--eval-problems", type=int, help="held-out problems to evaluate on (default: the "
                        "demo's num_test); the first num_test of them are the demo's held-out set")
    parser.add_argument("--model", help="a transformers folder (default: the demo's SmolLM2-135M-Instruct)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--eval-at-training-length", action="store_true", help="also evaluate greedily at "
                        "max_completion_tokens (a run-on policy's answers are cut there)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.eval_every < 1:
        parser.error("need --steps >= 1 and --eval-every >= 1")
    if args.eval_problems is not None and args.eval_problems < 1:
        parser.error(f"--eval-problems {args.eval_problems} must be >= 1")
    variants = [json.loads(v) for v in args.variant] or [{}]
    results = {json.dumps(v, sort_keys=True): run_variant(v, steps=args.steps, eval_every=args.eval_every,
                                                          model=args.model, threads=args.threads,
                                                          eval_problems=args.eval_problems,
                                                          at_training_length=args.eval_at_training_length)
               for v in variants}
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
