"""GRPO + LoRA on GSM8K (openai/gsm8k from the hub, or a local JSONL file), sized for one 8-24 GB GPU.

Rewards: MathAccuracy (the final answer, read from the last \\boxed{}) plus a small BoxedFormat bonus.
Memory: LoRA r=16, gradient checkpointing, 8-bit AdamW, micro-batches of 8 completions.

    python examples/gsm8k_lora.py --model Qwen/Qwen2.5-0.5B-Instruct --max-steps 200
    python examples/gsm8k_lora.py --data path/to/gsm8k/train.jsonl   # a local copy, no download
"""

from __future__ import annotations

import argparse

from grpo_engine import GRPOConfig, GRPOTrainer, LoRA, MemoryPlan
from grpo_engine.data import ChatTemplate, load_gsm8k
from grpo_engine.rewards import BoxedFormat, MathAccuracy

INSTRUCTION = "\nSolve the problem step by step, then give the final answer as \\boxed{number}."


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct",
                        help="hub id or local transformers folder")
    parser.add_argument("--data", default=None,
                        help="local GSM8K JSONL (question, answer); default: openai/gsm8k's train split")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--output-dir", default="runs/gsm8k_lora")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-completion-tokens", type=int, default=256)
    parser.add_argument("--optimizer", choices=["adamw8bit", "adamw"], default="adamw8bit")
    parser.add_argument("--no-progress-bar", action="store_true")
    args = parser.parse_args(argv)

    # None downloads the hub's train split; target = the number after "####", the worked solution in metadata
    prompts = load_gsm8k(args.data)
    config = GRPOConfig(
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        max_prompt_tokens=512,
        max_completion_tokens=args.max_completion_tokens,
        max_steps=args.max_steps,
        learning_rate=1e-4,
        warmup_steps=min(10, args.max_steps // 10),
        lr_schedule="cosine",
        output_dir=args.output_dir,
        progress_bar=not args.no_progress_bar,
    )
    memory = MemoryPlan(lora=LoRA(r=16), gradient_checkpointing=True, optimizer=args.optimizer,
                        micro_batch_size=8)
    trainer = GRPOTrainer(
        args.model,
        [MathAccuracy(), BoxedFormat(weight=0.1)],
        prompts,
        config=config,
        memory=memory,
        template=ChatTemplate(instruction=INSTRUCTION),
    )
    history = trainer.train()
    print(f"{trainer.step_count} steps; metrics in {args.output_dir}/metrics.jsonl, "
          f"adapter in {args.output_dir}/final")
    return history


if __name__ == "__main__":
    main()
