"""GRPO + LoRA on GSM8K (openai/gsm8k from the hub, or a local JSONL file), sized for one 8-24 GB GPU.

Rewards: MathAccuracy (the final answer, read from the last \\boxed{}) plus a small BoxedFormat bonus.
Memory: LoRA r=16, gradient checkpointing, 8-bit AdamW, micro-batches of 8 completions; or, with
--budget-gib, the plan grpo_engine.memory.auto_plan predicts fits that much accelerator memory
(LoRA r=16 in bfloat16, as `grpo-engine plan` chooses it; it prints what it chose and why).

    python examples/gsm8k_lora.py --model Qwen/Qwen2.5-0.5B-Instruct --max-steps 200
    python examples/gsm8k_lora.py --dtype bfloat16 --eval-every 50    # on a GPU: bf16 base, held-out pass@1
    python examples/gsm8k_lora.py --budget-gib 8 --eval-every 50      # the plan that fits an 8 GiB card
    python examples/gsm8k_lora.py --data path/to/gsm8k/train.jsonl   # a local copy, no download
"""

from __future__ import annotations

import argparse

from grpo_engine import GRPOConfig, GRPOTrainer, HeldOutEval, LoRA, MemoryPlan
from grpo_engine.data import ChatTemplate, load_gsm8k
from grpo_engine.memory import auto_plan
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
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the frozen base weights' dtype (bfloat16 on a GPU; the adapters stay float32)")
    parser.add_argument("--budget-gib", type=float, default=None,
                        help="take the memory plan predicted to fit this much accelerator memory "
                             "(instead of --optimizer and --dtype)")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="greedy pass@1 on held-out problems every this many steps (0: no evaluation)")
    parser.add_argument("--eval-data", default=None,
                        help="local GSM8K test JSONL; default: openai/gsm8k's test split")
    parser.add_argument("--eval-size", type=int, default=200, help="held-out problems (the first ones)")
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
    if args.budget_gib:  # what `grpo-engine plan --budget-gib N` chooses for this workload (a prediction)
        base = MemoryPlan(lora=LoRA(r=16), dtype="bfloat16", micro_batch_size=config.completions_per_step)
        memory = auto_plan(args.model, config, budget_gib=args.budget_gib, base=base)
    else:
        memory = MemoryPlan(lora=LoRA(r=16), gradient_checkpointing=True, optimizer=args.optimizer,
                            micro_batch_size=8, dtype=args.dtype)
    callbacks = []
    if args.eval_every:
        held_out = load_gsm8k(args.eval_data, split="test", limit=args.eval_size)
        callbacks.append(HeldOutEval(held_out, every_steps=args.eval_every))  # at max-completion-tokens
    trainer = GRPOTrainer(
        args.model,
        [MathAccuracy(), BoxedFormat(weight=0.1)],
        prompts,
        config=config,
        memory=memory,
        template=ChatTemplate(instruction=INSTRUCTION),
        callbacks=callbacks,
    )
    history = trainer.train()
    print(f"{trainer.step_count} steps; metrics in {args.output_dir}/metrics.jsonl, "
          f"adapter in {args.output_dir}/final")
    return history


if __name__ == "__main__":
    main()
