"""GRPO runs sampling with vLLM under torchrun and in one process, for tests/vllm/test_vllm_torchrun.py.

    torchrun --standalone --nproc_per_node 2 tests/vllm/_torchrun_vllm.py OUT CASE [--server URL]
    python tests/vllm/_torchrun_vllm.py OUT CASE [--server URL]     # one process

CASE ``colocated``: a ``VLLMSampler`` per rank (its own engine; the LoRA adapter synced to it every step);
``server``: a ``VLLMServerSampler`` per rank, every rank on the one server at URL (rank 0 loads the
adapter, the others wait). SmolLM2-135M-Instruct in float32 with LoRA (r=4) trains 2 steps of 4 prompts
x 4 completions, and each rank writes ``OUT/<case>/rank<r>.pt``: per step the whole step's sampled ids,
mask and sampler log-probs (as every rank holds them after the gather), the prompts (first, count, seed)
this rank's sampler was called with, the summed gradient (just before ``optimizer.step()``), the LoRA
weights after the step, the logged metrics (times left out; the sync's seconds apart) and the adapter the
server sampled with.
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine

import torch  # noqa: E402

from grpo_engine import Callback, GRPOConfig, GRPOTrainer, LoRA, MemoryPlan  # noqa: E402
from grpo_engine.demo import smollm2_folder  # noqa: E402
from grpo_engine.memory.apply import trainable_parameters  # noqa: E402
from grpo_engine.models import load_model  # noqa: E402
from grpo_engine.types import Prompt  # noqa: E402

PROMPTS = [Prompt(f"What is {a} + {b}?", str(a + b)) for a in range(2, 9) for b in range(3, 7)]
STEPS = 2


def short(completions, **columns):
    """Shorter is better: varies within a group, so every step trains."""
    return [1.0 / (1 + len(c)) for c in completions]


class Samples(Callback):
    """Records each step's whole batch (every rank holds it after the gather)."""

    def __init__(self, record: dict) -> None:
        self.record = record

    def on_rollout(self, trainer, state, control, *, batch, rewards, uncertainty):
        self.record["samples"].append({"ids": batch.completion_ids.clone(),
                                       "mask": batch.completion_mask.clone(),
                                       "logprobs": batch.sampler_logprobs.clone()})


def sampler_of(case: str, model, tokenizer, server: str | None):
    folder = smollm2_folder()
    if case == "colocated":
        from grpo_engine.sampling.vllm import VLLMSampler

        return VLLMSampler(model, tokenizer, engine_model=folder, max_completion_tokens=8, max_lora_rank=8,
                           gpu_memory_utilization=0.05, engine_kwargs={"enforce_eager": True})
    from grpo_engine.sampling.vllm_server import VLLMServerSampler

    assert server is not None, "the server case needs --server URL"
    return VLLMServerSampler(model, tokenizer, base_url=server, max_completion_tokens=8)


def run(case: str, out: Path, server: str | None) -> None:
    """Trains the case for STEPS steps and writes this rank's record."""
    model, tokenizer = load_model(str(smollm2_folder()))
    sampler = sampler_of(case, model, tokenizer, server)
    record: dict = {"samples": [], "calls": [], "grads": [], "weights": [], "metrics": [], "adapters": [],
                    "sync_s": []}
    sample = sampler.sample

    def recording_sample(prompts, **kwargs):  # which prompts of the step this rank sampled
        record["calls"].append((kwargs["draws"].first_prompt, len(prompts), kwargs["draws"].seed))
        return sample(prompts, **kwargs)

    sampler.sample = recording_sample
    config = GRPOConfig(prompts_per_step=4, group_size=4, max_completion_tokens=8, max_prompt_tokens=256,
                        learning_rate=1e-2, max_steps=STEPS, seed=3, output_dir=str(out / case),
                        progress_bar=False)
    trainer = GRPOTrainer(model, [short], PROMPTS, config, MemoryPlan(lora=LoRA(r=4)), tokenizer=tokenizer,
                          sampler=sampler, callbacks=[Samples(record)])
    step = trainer.optimizer.step

    @functools.wraps(step)  # keeps torch's scheduler marker
    def recording_step(*args, **kwargs):
        record["grads"].append([p.grad.detach().clone() for p in trainable_parameters(trainer.model)])
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    record["start"] = [p.detach().clone() for p in trainable_parameters(trainer.model)]
    while trainer.step_count < STEPS:
        metrics = trainer.step()
        clocks = ("time/", "tokens/generated_")  # wall-clock figures differ between any two runs
        record["metrics"].append({k: v for k, v in metrics.items() if not k.startswith(clocks)})
        record["sync_s"].append(metrics["time/sync_s"])
        record["adapters"].append(getattr(sampler, "_adapter_name", None))  # what the server was asked for
        record["weights"].append([p.detach().clone() for p in trainable_parameters(trainer.model)])
    record["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # trainer + engine
    (out / case).mkdir(parents=True, exist_ok=True)
    torch.save(record, out / case / f"rank{trainer.world.rank}.pt")
    if torch.distributed.is_initialized() and trainer.world.size > 1:
        torch.distributed.barrier()  # every rank done before vLLM's teardown ends the group
    sampler.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("case", choices=["colocated", "server"])
    parser.add_argument("--server")
    args = parser.parse_args()
    torch.set_num_threads(1)
    run(args.case, Path(args.out), args.server)


if __name__ == "__main__":
    main()
