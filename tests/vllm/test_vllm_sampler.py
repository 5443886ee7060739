"""VLLMSampler against the real engine (vllm-cpu) on SmolLM2-135M-Instruct in float32: its log-probs equal
the trainer's recomputed ones without an adapter, with one, and after a training step (the sync reached
the engine). Runs in the vLLM venv (``make test-vllm``); skipped where vLLM is not installed."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU

from grpo_engine.demo import smollm2_folder  # noqa: E402
from grpo_engine.logprobs import completion_logprobs  # noqa: E402
from grpo_engine.models import load_model  # noqa: E402
from grpo_engine.sampling.vllm import VLLMSampler  # noqa: E402
from grpo_engine.types import Draws, Prompt  # noqa: E402

PROMPTS = [Prompt("What is 7 + 5?", "12"), Prompt("Name a prime number.", "2")]
TOLERANCE = 1e-4  # float32: vLLM's kernels against transformers' (2e-5 seen)


def trainer_logprobs(model, batch):
    with torch.no_grad():
        return completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                   batch.completion_mask)


def assert_match(model, batch):
    ours = trainer_logprobs(model, batch)
    keep = batch.completion_mask
    assert keep.sum() > 10
    assert (ours[keep] - batch.sampler_logprobs[keep]).abs().max() < TOLERANCE


@pytest.fixture(scope="module")
def folder():
    return smollm2_folder()


@pytest.fixture(scope="module")
def full(folder):
    model, tokenizer = load_model(str(folder))
    return model, VLLMSampler(model, tokenizer, engine_model=folder, max_completion_tokens=24,
                              engine_kwargs={"enforce_eager": True})


def with_adapter(folder, lora_sync):
    from peft import LoraConfig, get_peft_model

    model, tokenizer = load_model(str(folder))
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    for name, param in model.named_parameters():  # a non-zero adapter, so that it changes the log-probs
        if "lora_B" in name:
            param.data.normal_(0, 0.02)
    return model, VLLMSampler(model, tokenizer, engine_model=folder, max_completion_tokens=24,
                              lora_sync=lora_sync, engine_kwargs={"enforce_eager": True})


@pytest.fixture(scope="module", params=["adapter", "merged"])
def adapted(folder, request):
    return with_adapter(folder, request.param)


def test_the_engines_logprobs_equal_the_trainers_without_an_adapter(full):
    model, sampler = full
    batch = sampler.sample(PROMPTS, group_size=4, temperature=1.0, draws=Draws(seed=1))
    assert batch.completion_ids.shape[0] == 8 and batch.texts[0]
    assert_match(model, batch)
    # an EOS ends a completion, kept and counted; a completion without one is truncated
    for row, keep, cut in zip(batch.completion_ids, batch.completion_mask, batch.is_truncated.tolist()):
        assert (int(row[keep][-1]) in sampler.eos_ids) != cut
        assert cut or int(keep.sum()) < sampler.max_completion_tokens or int(row[keep][-1]) in sampler.eos_ids


def test_the_same_seed_samples_the_same_completions(full):
    _, sampler = full
    a = sampler.sample(PROMPTS, group_size=2, temperature=1.0, draws=Draws(seed=5))
    b = sampler.sample(PROMPTS, group_size=2, temperature=1.0, draws=Draws(seed=5))
    assert torch.equal(a.completion_ids, b.completion_ids)


def test_logprobs_at_another_temperature_are_the_trainers_at_that_temperature(full):
    model, sampler = full
    batch = sampler.sample(PROMPTS, group_size=2, temperature=0.7, draws=Draws(seed=2))
    with torch.no_grad():
        ours = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                   batch.completion_mask, temperature=0.7)
    keep = batch.completion_mask
    assert (ours[keep] - batch.sampler_logprobs[keep]).abs().max() < TOLERANCE


def step_and_check(model, sampler, lr):
    """Samples, takes an SGD step, samples again: both match the trainer, the engine's log-probs of the first
    batch moved as the trainer's did, and with nothing changed there is no sync and the same draws."""
    first = sampler.sample(PROMPTS, group_size=4, temperature=1.0, draws=Draws(seed=3))
    assert_match(model, first)
    assert sampler.last_sync_seconds > 0 and first.metrics["time/sync_s"] > 0
    # a training step: the weights move in place, so the next sample syncs them
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    logprobs = completion_logprobs(model, first.prompt_ids, first.prompt_mask, first.completion_ids,
                                   first.completion_mask)
    (-logprobs.sum()).backward()
    optimizer.step()
    again = sampler.sample(PROMPTS, group_size=4, temperature=1.0, draws=Draws(seed=3))
    assert sampler.last_sync_seconds > 0
    assert_match(model, again)
    # the engine's log-probs of the first batch's tokens moved exactly as the trainer's did
    moved = trainer_logprobs(model, first) - first.sampler_logprobs
    assert moved[first.completion_mask].abs().max() > 1e-3
    unchanged = sampler.sample(PROMPTS, group_size=4, temperature=1.0, draws=Draws(seed=3))
    assert sampler.last_sync_seconds == 0.0  # nothing changed: no sync
    assert torch.equal(unchanged.completion_ids, again.completion_ids)


def test_the_engines_logprobs_equal_the_trainers_with_an_adapter_and_after_a_step(adapted):
    step_and_check(*adapted, lr=0.1)


def test_a_run_with_vllm_resumes_from_its_checkpoint_as_it_ran(folder, tmp_path):
    from grpo_engine import GRPOConfig, GRPOTrainer, LoRA, MemoryPlan

    def short(completions, **columns):  # varies within a group: every step trains
        return [1.0 / (1 + len(c)) for c in completions]

    prompts = [Prompt(f"What is {a} + {b}?", str(a + b)) for a in range(2, 9) for b in range(3, 7)]

    def run(resume=None):
        model, tokenizer = load_model(str(folder))
        sampler = VLLMSampler(model, tokenizer, engine_model=folder, max_completion_tokens=8,
                              lora_sync="merged", engine_kwargs={"enforce_eager": True})
        config = GRPOConfig(prompts_per_step=2, group_size=4, max_completion_tokens=8, max_steps=2,
                            learning_rate=1e-3, save_every_steps=1, output_dir=str(tmp_path),
                            progress_bar=False)
        trainer = GRPOTrainer(model, [short], prompts, config, MemoryPlan(lora=LoRA(r=4)),
                              tokenizer=tokenizer, sampler=sampler, resume_from=resume)
        history = trainer.train()
        sampler.close()
        return history

    whole = run()
    resumed = run(resume=str(tmp_path / "checkpoint-1"))
    assert len(resumed) == 1 and resumed[0]["time/sync_s"] > 0  # the restored adapter reached the engine
    for key in ("loss", "reward/mean", "completion_length/mean", "grad_norm"):
        assert resumed[0][key] == whole[1][key], key
