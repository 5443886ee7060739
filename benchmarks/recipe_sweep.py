"""Variants of the demo recipe at a fixed step budget: held-out accuracy every N steps.

The evidence behind the demo's defaults (docs/benchmarks.md, "Evidence for the remaining
defaults"). Each variant changes fields of ``grpo_engine.demo.DemoSettings`` (and optionally the
learning-rate schedule) and trains our engine alone from the base model on the demo task; greedy
held-out accuracy (24 new tokens, the 64 test problems) is measured every ``--eval-every`` steps.
A step budget, not a time budget, so that a shared machine does not change what is measured.

    python benchmarks/recipe_sweep.py --steps 80 --eval-every 20 \\
        --variant '{}' --variant '{"temperature": 0.8}' --variant '{"lr_schedule": "linear"}'

The last stdout line is one JSON object: ``{variant label: {"curve": [[step, accuracy], ...],
"step_s": median step seconds}}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def run_variant(variant: dict, *, steps: int, eval_every: int, model: str | None, threads: int | None) -> dict:
    """Trains the demo recipe with ``variant`` applied; returns its accuracy curve and step time."""
    import torch

    from grpo_engine import GRPOConfig, GRPOTrainer, LoRA, MemoryPlan
    from grpo_engine.data import ChatTemplate, arithmetic_task
    from grpo_engine.demo import DemoSettings, smollm2_folder
    from grpo_engine.eval import greedy_accuracy
    from grpo_engine.models import load_model
    from grpo_engine.rewards import MathAccuracy

    if threads:
        torch.set_num_threads(threads)
    schedule = variant.get("lr_schedule", "constant")
    s = dataclasses.replace(DemoSettings(), **{k: v for k, v in variant.items() if k != "lr_schedule"})
    torch.manual_seed(s.seed)
    policy, tokenizer = load_model(model or smollm2_folder())
    train, test = arithmetic_task(s.num_train, s.num_test, seed=s.seed)
    template, reward = ChatTemplate(instruction=s.instruction), MathAccuracy()
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            prompts_per_step=s.prompts_per_step, group_size=s.group_size, max_completion_tokens=s.max_completion_tokens,
            max_prompt_tokens=128, max_steps=steps, temperature=s.temperature, learning_rate=s.learning_rate,
            lr_schedule=schedule, seed=s.seed, output_dir=out, progress_bar=False,
        )
        memory = MemoryPlan(lora=LoRA(r=s.lora_r, alpha=2 * s.lora_r), micro_batch_size=s.micro_batch_size)
        trainer = GRPOTrainer(policy, [reward], train, config=config, memory=memory, tokenizer=tokenizer,
                              template=template)
        curve = []
        for step in range(1, steps + 1):
            trainer.step()
            if step % eval_every == 0 or step == steps:
                accuracy = greedy_accuracy(trainer.model, tokenizer, test, reward, template=template,
                                           max_new_tokens=s.eval_max_new_tokens, batch_size=len(test)).accuracy
                curve.append([step, accuracy])
                print(f"[sweep] {json.dumps(variant)} step {step}: {accuracy:.4f}", flush=True)
    return {"curve": curve, "step_s": statistics.median(m["time/step_s"] for m in trainer.history)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", default=[], help="JSON: DemoSettings fields and/or "
                        "lr_schedule to change (repeatable; default: the shipped recipe only)")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--model", help="a transformers folder (default: the demo's SmolLM2-135M-Instruct)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.eval_every < 1:
        parser.error("need --steps >= 1 and --eval-every >= 1")
    variants = [json.loads(v) for v in args.variant] or [{}]
    results = {json.dumps(v, sort_keys=True): run_variant(v, steps=args.steps, eval_every=args.eval_every,
                                                          model=args.model, threads=args.threads)
               for v in variants}
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
