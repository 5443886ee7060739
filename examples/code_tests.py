"""GRPO on a code reward: small Python functions, each scored by ``CodeTests`` in the sandbox.

Each task asks for one function (``def f(x): ...``: a larger of two, a digit sum, a count of multiples, ...
with three tests written as asserts; ``CodeTests`` converts them into call tests, runs the completion's
code in the sandbox and compares the returned values on the host: the expected values never enter the
sandbox, so the only way to score is to return them. Before and after a time-budgeted LoRA run: the
held-out pass rate (fraction of tests passed), near-greedy and sampled, on tasks it never trained on.

    python examples/code_tests.py                       # SmolLM2-135M-Instruct, built offline
    python examples/code_tests.py --model PATH --budget-s 600 --eval-size 64
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from grpo_engine import GRPOConfig, GRPOTrainer, LoRA, MemoryPlan
from grpo_engine.data import ChatTemplate
from grpo_engine.models import load_model
from grpo_engine.rewards import CodeTests
from grpo_engine.sampling import HFSampler
from grpo_engine.types import Prompt

INSTRUCTION = "\nAnswer with the function in a ```python code block."
# (what the function does, what it returns for x and k); SmolLM2-135M solves some greedily, few at T = 1
OPERATIONS = [("returns x if x is even, otherwise {k} times x", lambda x, k: x if x % 2 == 0 else k * x),
              ("returns the larger of x and {k}", lambda x, k: max(x, k)),
              ("returns how many multiples of {k} there are from 1 to x", lambda x, k: x // k),
              ("returns x squared minus {k} times x", lambda x, k: x * x - k * x),
              ("returns the absolute value of x minus {k}", lambda x, k: abs(x - k)),
              ("returns 1 if x is divisible by {k}, otherwise 0", lambda x, k: int(x % k == 0)),
              ("returns the sum of the digits of x plus {k}", lambda x, k: sum(map(int, str(x))) + k),
              ("returns the sum of the integers from 1 to x, plus {k}", lambda x, k: x * (x + 1) // 2 + k)]


def tasks(seed: int) -> list[Prompt]:
    """Every task "Write a Python function f(x) that <operation with k>." (8 operations, k from 2 to 40),
    shuffled by ``seed``, each with three assert tests on seeded inputs from 1 to 39."""
    rng, out = random.Random(seed), []
    for words, value in OPERATIONS:
        for k in range(2, 41):
            inputs = rng.sample(range(1, 40), 3)
            tests = [f"assert f({x}) == {value(x, k)}" for x in inputs]
            question = f"Write a Python function f(x) that {words.format(k=k)}."
            out.append(Prompt(question, metadata={"tests": tests}))
    rng.shuffle(out)
    return out


def measure(sampler: HFSampler, reward: CodeTests, prompts: list[Prompt]) -> dict[str, float]:
    """Held-out pass rate (the mean fraction of tests passed): near-greedy (temperature 0.05, one completion
    per task), and sampled (temperature 1, four per task)."""
    out = {}
    for name, temperature, group in (("greedy", 0.05, 1), ("sampled", 1.0, 4)):
        torch.manual_seed(0)
        batch = sampler.sample(prompts, group_size=group, temperature=temperature)
        scores = reward.score_batch([p for p in prompts for _ in range(group)], list(batch.texts))
        out[f"pass_rate_{name}"] = round(sum(scores) / len(scores), 4)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a local transformers folder (default: SmolLM2-135M)")
    parser.add_argument("--budget-s", type=float, default=360.0, help="training seconds")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--eval-size", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-completion-tokens", type=int, default=96)
    parser.add_argument("--output-dir", default="runs/code_tests")
    parser.add_argument("--no-progress-bar", action="store_true")
    args = parser.parse_args(argv)
    if args.model is None:
        from grpo_engine.demo import smollm2_folder

        args.model = str(smollm2_folder())
    model, tokenizer = load_model(args.model)
    every = tasks(seed=0)  # 312 tasks: the first eval_size held out, never trained on
    held_out, train = every[:args.eval_size], every[args.eval_size:]
    reward = CodeTests(timeout_s=5.0, memory_mb=256)
    template = ChatTemplate(instruction=INSTRUCTION)
    config = GRPOConfig(prompts_per_step=4, group_size=args.group_size,
                        max_completion_tokens=args.max_completion_tokens, max_prompt_tokens=256,
                        max_steps=args.max_steps, max_train_seconds=args.budget_s, learning_rate=2e-4,
                        temperature=1.0, output_dir=args.output_dir, progress_bar=not args.no_progress_bar,
                        seed=0)
    memory = MemoryPlan(lora=LoRA(r=16, alpha=32), micro_batch_size=8)
    trainer = GRPOTrainer(model, [reward], train, config, memory, tokenizer=tokenizer, template=template)
    evaluator = HFSampler(trainer.model, tokenizer, template=template, max_prompt_tokens=256,
                          max_completion_tokens=args.max_completion_tokens)
    before = measure(evaluator, reward, held_out)
    history = trainer.train()
    after = measure(evaluator, reward, held_out)
    report = {"before": before, "after": after, "steps": len(history),
              "train_reward_first_last": [round(history[0][f"reward/{reward.name}/mean"], 3),
                                          round(history[-1][f"reward/{reward.name}/mean"], 3)]}
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
