"""GRPO with a Python tool: products of two three-digit numbers, which a small model cannot do in its head
but can by running a program (the sandboxed ``python`` tool, grpo_engine.tools.python_tool).

Tool-integrated reasoning in ToRA's format (``CodeBlockParser``): a fenced Python block the model writes
is run, its turn ends at the closing fence, and what the program printed comes back as the tool's
message; the model then answers. Reward: ``correct``, the model's final turn states the product.
Before and after a time-budgeted LoRA run: held-out accuracy, tool-call rate and turns, greedy and at the
training temperature (one rollout per question each), on products it never trained on. ``--seed`` seeds
the run (LoRA's initialisation, the draws); the problems are the same for every seed.

    python examples/python_tool.py                      # SmolLM2-135M-Instruct, built offline
    python examples/python_tool.py --model PATH --budget-s 900 --eval-size 64
    python examples/python_tool.py --budget-s 600 --eval-size 64 --seed 1 --report runs/python_tool/seed1.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from grpo_engine import GRPOConfig, GRPOTrainer, LoRA, MemoryPlan
from grpo_engine.data import ChatTemplate
from grpo_engine.models import load_model
from grpo_engine.sampling import HFSampler
from grpo_engine.tools import CodeBlockParser, ToolSampler, python_tool
from grpo_engine.types import Draws, Prompt

INSTRUCTION = "\nWrite a Python program that prints the product, then state the number it printed."


def products(count: int, seed: int, avoid: frozenset[str] = frozenset()) -> list[Prompt]:
    """``count`` distinct questions "What is a * b?" with three-digit a and b, seeded, none in ``avoid``."""
    rng, seen, out = random.Random(seed), set(avoid), []
    while len(out) < count:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        question = f"What is {a} * {b}?"
        if question not in seen:
            seen.add(question)
            out.append(Prompt(question, target=str(a * b)))
    return out


def correct(prompts, completions, target, **columns):
    """1 when the final turn states the product (one of its numbers equals it), else 0."""
    return [float(t in {n.replace(",", "") for n in re.findall(r"\d[\d,]*", c)})
            for c, t in zip(completions, target)]


def measure(sampler: ToolSampler, prompts: list[Prompt], temperature: float,
            seed: int = 0) -> dict[str, float]:
    """Held-out accuracy, tool-call rate and mean turns, one rollout per question at ``temperature`` (0:
    greedy), its draws seeded by ``seed``."""
    batch = sampler.sample(prompts, group_size=1, temperature=temperature, draws=Draws(seed))
    right = correct(None, batch.texts, [p.target for p in prompts])
    calls = [float(bool(e.tool_calls)) for e in batch.episodes]
    return {"accuracy": sum(right) / len(right), "tool_call_rate": sum(calls) / len(calls),
            "turns_mean": sum(e.turns for e in batch.episodes) / len(prompts)}


def _quarters(values: list[float]) -> list[float]:
    """The mean of each quarter of a run's values (fewer parts for a short run)."""
    parts = min(4, len(values))
    cut = [round(i * len(values) / parts) for i in range(parts + 1)]
    return [round(sum(values[a:b]) / (b - a), 3) for a, b in zip(cut[:-1], cut[1:])]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a local transformers folder (default: SmolLM2-135M)")
    parser.add_argument("--budget-s", type=float, default=360.0, help="training seconds")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--eval-size", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-completion-tokens", type=int, default=160)
    parser.add_argument("--output-dir", default="runs/python_tool")
    parser.add_argument("--no-progress-bar", action="store_true")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed (the problems stay the same)")
    parser.add_argument("--report", help="also write the report (and the settings) to this JSON file")
    args = parser.parse_args(argv)
    if args.model is None:
        from grpo_engine.demo import smollm2_folder

        args.model = str(smollm2_folder())
    model, tokenizer = load_model(args.model)
    held_out = products(args.eval_size, seed=1)
    # the trainer adds LoRA to this model in place, so the sampler samples the policy being trained
    sampler = ToolSampler(HFSampler(model, tokenizer, template=ChatTemplate(instruction=INSTRUCTION),
                                    max_prompt_tokens=768, max_completion_tokens=args.max_completion_tokens),
                          tools=[python_tool(timeout_s=3.0)], parser=CodeBlockParser(), max_turns=3,
                          tool_timeout_s=5.0)
    config = GRPOConfig(prompts_per_step=4, group_size=args.group_size,
                        max_completion_tokens=args.max_completion_tokens,
                        max_prompt_tokens=768, max_steps=args.max_steps, max_train_seconds=args.budget_s,
                        learning_rate=2e-4, temperature=1.0,
                        output_dir=args.output_dir, progress_bar=not args.no_progress_bar, seed=args.seed)
    memory = MemoryPlan(lora=LoRA(r=16, alpha=32), micro_batch_size=4)
    train = products(4000, seed=0, avoid=frozenset(p.question for p in held_out))
    trainer = GRPOTrainer(model, [correct], train, config, memory, tokenizer=tokenizer, sampler=sampler)

    def both() -> dict[str, dict[str, float]]:  # greedy, and sampled as in training
        return {"greedy": measure(sampler, held_out, 0.0),
                "sampled": measure(sampler, held_out, config.temperature, seed=args.seed)}

    before = both()
    history = trainer.train()
    after = both()
    report = {"before": before, "after": after, "steps": len(history), "seed": args.seed,
              "temperature": config.temperature, "train_seconds": round(trainer.train_seconds, 1),
              "train_correct_by_quarter": _quarters([h["reward/correct/mean"] for h in history]),
              "train_tool_calls_by_quarter": _quarters([h["tools/calls"] for h in history])}
    print(json.dumps(report, indent=1))
    if args.report:
        report["settings"] = {k: v for k, v in vars(args).items() if k != "report"}
        path = Path(args.report)
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(path.name + ".tmp")
        scratch.write_text(json.dumps(report, indent=1))
        scratch.replace(path)  # whole or not at all
    return report


if __name__ == "__main__":
    main()
