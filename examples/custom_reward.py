"""A custom reward: subclass Reward, implement score(prompt, completion) -> float, train with it.

BareInteger rewards answering with nothing but the number: 1.0 when the whole completion is the
integer target, 0.5 when the target is only the last number of a longer text, else 0.0.
It is combined with MathAccuracy by weights (see docs/rewards.md).

    python examples/custom_reward.py --max-steps 20
"""

from __future__ import annotations

import argparse
import re

from grpo_engine import GRPOConfig, GRPOTrainer, LoRA, MemoryPlan
from grpo_engine.data import arithmetic_task
from grpo_engine.rewards import MathAccuracy, Reward
from grpo_engine.types import Prompt


class BareInteger(Reward):
    """1.0 if the completion is exactly the integer target, 0.5 if its last number is, else 0.0."""

    def score(self, prompt: Prompt, completion: str) -> float:
        if prompt.target is None:
            raise ValueError("BareInteger needs Prompt.target, the integer answer; "
                             "build Prompt(q, target='12')")
        text = completion.strip()
        if re.fullmatch(r"-?\d+", text):
            return 1.0 if int(text) == int(prompt.target) else 0.0
        numbers = re.findall(r"-?\d+", text)
        return 0.5 if numbers and int(numbers[-1]) == int(prompt.target) else 0.0


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model",
                        help="local transformers folder (default: SmolLM2-135M-Instruct, converted once)")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--output-dir", default="runs/custom_reward")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-completion-tokens", type=int, default=24)
    parser.add_argument("--no-progress-bar", action="store_true")
    args = parser.parse_args(argv)

    reward = BareInteger(weight=0.5)  # name defaults to "bare_integer"
    question = Prompt("What is 7 + 5?", target="12")
    examples = ["12", "7 + 5 = 12", "13", "The answer is twelve."]
    for text, value in zip(examples, reward([question] * len(examples), examples).tolist()):
        print(f"{reward.name}({text!r}) = {value}")  # 1.0, 0.5, 0.0, 0.0

    if args.model is None:
        from grpo_engine.demo import smollm2_folder

        args.model = smollm2_folder()
    train, _ = arithmetic_task(num_train=1000, num_test=0, seed=0)
    config = GRPOConfig(
        prompts_per_step=4, group_size=args.group_size, max_completion_tokens=args.max_completion_tokens,
        max_steps=args.max_steps, learning_rate=2e-4, output_dir=args.output_dir,
        progress_bar=not args.no_progress_bar,
    )
    memory = MemoryPlan(lora=LoRA(r=16, alpha=32), micro_batch_size=16)
    # total reward = 1.0 * math_accuracy + 0.5 * bare_integer; both are logged under reward/<name>/mean
    trainer = GRPOTrainer(args.model, [MathAccuracy(), reward], train, config=config, memory=memory)
    return trainer.train()


if __name__ == "__main__":
    main()
