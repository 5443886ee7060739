"""The demo's GRPO run with vLLM as the sampler: held-out accuracy before and after, and the engines'
per-step mismatch, on SmolLM2-135M-Instruct (the demo's task, recipe and budget; truncated importance
sampling on, ``tis_cap=2``).

    .venv-vllm/bin/python benchmarks/vllm_learning.py [--train-seconds 480] [--lora-sync merged]

Needs the vLLM venv (``make vllm-venv``); run it alone. Held-out accuracy is the demo's (greedy, our
evaluator); each step logs ``mismatch/logprob_abs`` (mean |log π_trainer - log π_vLLM| over its tokens),
``mismatch/capped_fraction`` and ``time/sync_s``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
from pathlib import Path

import _harness  # puts the repository on sys.path
import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from grpo_engine import GRPOConfig, GRPOTrainer, LoRA, MemoryPlan  # noqa: E402
from grpo_engine.data import ChatTemplate  # noqa: E402
from grpo_engine.demo import DemoSettings, demo_task, recipe_components, recipe_rewards, smollm2_folder  # noqa: E402
from grpo_engine.eval import greedy_accuracy  # noqa: E402
from grpo_engine.models import load_model  # noqa: E402
from grpo_engine.rewards import MathAccuracy  # noqa: E402
from grpo_engine.sampling.vllm import VLLMSampler  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-seconds", type=float, default=480.0)
    parser.add_argument("--lora-sync", choices=["merged", "adapter"], default="merged",
                        help="VLLMSampler(lora_sync=...): vLLM's LoRA kernels are ~16x slower on the CPU")
    parser.add_argument("--out", help="also write the JSON report here")
    args = parser.parse_args(argv)
    s = DemoSettings(train_seconds=args.train_seconds)
    torch.manual_seed(s.seed)
    folder = smollm2_folder()
    model, tokenizer = load_model(str(folder))
    train, test = demo_task(s)
    template, reward = ChatTemplate(instruction=s.instruction), MathAccuracy()

    def accuracy(policy: torch.nn.Module) -> float:
        return greedy_accuracy(policy, tokenizer, test, reward, template=template,
                               max_new_tokens=s.eval_max_new_tokens, batch_size=s.num_test).accuracy

    before = accuracy(model)
    config = GRPOConfig(prompts_per_step=s.prompts_per_step, group_size=s.group_size,
                        max_completion_tokens=s.max_completion_tokens, max_prompt_tokens=128,
                        max_steps=s.max_steps, max_train_seconds=s.train_seconds, time_budget="calibrated",
                        warmup_steps=s.calibration_steps, replan_step=s.replan_step,
                        temperature=s.temperature,
                        learning_rate=s.learning_rate, lr_schedule=s.lr_schedule, seed=s.seed,
                        lr_reference_steps=s.lr_reference_steps, max_learning_rate=s.max_learning_rate,
                        output_dir=tempfile.mkdtemp(prefix="vllm-learning-"), progress_bar=False)
    memory = MemoryPlan(lora=LoRA(r=s.lora_r, alpha=2 * s.lora_r), micro_batch_size=s.micro_batch_size)
    components = recipe_components(s)
    components["loss"] = dataclasses.replace(components["loss"], tis_cap=2.0)
    sampler = VLLMSampler(model, tokenizer, engine_model=folder, template=template,
                          max_prompt_tokens=128, max_completion_tokens=s.max_completion_tokens,
                          lora_sync=args.lora_sync, engine_kwargs={"enforce_eager": True})
    trainer = GRPOTrainer(model, recipe_rewards(s, reward), train, config=config, memory=memory,
                          tokenizer=tokenizer, sampler=sampler, **components)
    history = trainer.train()
    after = accuracy(trainer.model)
    trained = [h for h in history if "mismatch/logprob_abs" in h]  # a step that trained no row has none
    mismatch = [h["mismatch/logprob_abs"] for h in trained]
    report = {"before_accuracy": before, "after_accuracy": after, "steps": len(history),
              "train_s": round(trainer.train_seconds, 1),
              "step_s_median": round(statistics.median(h["time/step_s"] for h in history), 2),
              "sync_s_median": round(statistics.median(h["time/sync_s"] for h in history), 3),
              "steps_that_trained": len(trained),
              "mismatch_logprob_abs_max": max(mismatch, default=None),
              "mismatch_logprob_abs_mean": statistics.mean(mismatch) if mismatch else None,
              "capped_fraction_max": max((h["mismatch/capped_fraction"] for h in trained), default=None)}
    print(json.dumps(report, indent=1), flush=True)
    if args.out:
        _harness.write_report(Path(args.out), report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
