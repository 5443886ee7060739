"""Generation speed: vLLM (``VLLMSampler``) against our decoder (``HFSampler``), side by side in one run,
on SmolLM2-135M-Instruct with a LoRA adapter (r=16, as the demo trains it), at the demo's shapes.

    .venv-vllm/bin/python benchmarks/vllm_generation.py [--tokens 16 128] [--repetitions 3]
        [--lora-sync merged adapter] [--adapter-max-tokens 16]

Each repetition samples the demo's step (8 arithmetic prompts x 4 completions) once with each sampler,
in turn; the figure is generated tokens per second of the whole ``sample()`` call (vLLM's includes its
weight sync: the adapter changes before every call, as after an optimizer step). vLLM runs with
both LoRA syncs: ``adapter`` (its LoRA kernels) and ``merged`` (the adapter merged into the weights).
Run it alone: the two CPU cores are the measurement. Needs the vLLM venv (``make vllm-venv``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import _harness  # puts the repository on sys.path
import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from grpo_engine.data import ChatTemplate, arithmetic_task  # noqa: E402
from grpo_engine.demo import DemoSettings, smollm2_folder  # noqa: E402
from grpo_engine.models import load_model  # noqa: E402
from grpo_engine.sampling import HFSampler  # noqa: E402
from grpo_engine.sampling.vllm import VLLMSampler  # noqa: E402
from grpo_engine.types import Draws  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 128], help="max completion tokens")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--lora-sync", nargs="+", default=["merged", "adapter"], help="VLLMSampler modes")
    parser.add_argument("--adapter-max-tokens", type=int, default=16,
                        help="run lora_sync='adapter' (slow on the CPU) only up to this many tokens")
    parser.add_argument("--out", help="also write the JSON report here")
    args = parser.parse_args(argv)
    from peft import LoraConfig, get_peft_model

    demo = DemoSettings()
    folder = smollm2_folder()
    model, tokenizer = load_model(str(folder))
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=demo.lora_r, lora_alpha=2 * demo.lora_r,
                                             target_modules="all-linear"))
    prompts, _ = arithmetic_task(demo.prompts_per_step, 1, seed=0)
    template = ChatTemplate(instruction=demo.instruction)
    report = {"shape": f"{demo.prompts_per_step} prompts x {demo.group_size}",
              "threads": torch.get_num_threads()}
    for tokens in args.tokens:
        samplers = {"ours": HFSampler(model, tokenizer, template=template, max_completion_tokens=tokens,
                                      merge_lora=True)}
        for sync in args.lora_sync if tokens <= args.adapter_max_tokens else ["merged"]:
            samplers[f"vllm_{sync}"] = VLLMSampler(model, tokenizer, engine_model=folder, template=template,
                                                   max_completion_tokens=tokens, lora_sync=sync,
                                                   engine_kwargs={"enforce_eager": True})
        rates: dict[str, list[float]] = {name: [] for name in samplers}
        for rep in range(args.repetitions + 1):  # the first is a warm-up
            for name, sampler in samplers.items():
                with torch.no_grad():
                    for p in model.parameters():  # an optimizer step's change: vLLM syncs the adapter
                        if p.requires_grad:
                            p.add_(1e-6)
                start = time.perf_counter()
                batch = sampler.sample(prompts, group_size=demo.group_size, temperature=1.0,
                                       draws=Draws(seed=rep))
                seconds = time.perf_counter() - start
                if rep:
                    rates[name].append(int(batch.completion_mask.sum()) / seconds)
        for sampler in samplers.values():
            if isinstance(sampler, VLLMSampler):
                sampler.close()
        summary = {name: round(sum(r) / len(r), 1) for name, r in rates.items()}
        ratios = {k: round(v / summary["ours"], 2) for k, v in summary.items()}
        report[f"tokens_{tokens}"] = {"tokens_per_s": summary, "over_ours": ratios}
        print(json.dumps({tokens: report[f"tokens_{tokens}"]}), flush=True)
    if args.out:
        _harness.write_report(Path(args.out), report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
