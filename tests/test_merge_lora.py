"""Sampling with the LoRA adapters merged: the same function, the stored weights untouched, and
clear refusals where a merge would not be exact."""

import bitsandbytes as bnb
import pytest
import torch

from grpo_engine import LoRA, MemoryPlan
from grpo_engine.config import ConfigError
from grpo_engine.data import PlainTemplate
from grpo_engine.logprobs import completion_logprobs
from grpo_engine.memory import prepare_model
from grpo_engine.memory.estimate import ModelShape, Workload, estimate_memory
from grpo_engine.sampling.hf import HFSampler
from grpo_engine.sampling.merge import check_mergeable, merged_lora
from grpo_engine.types import Prompt

from .test_trainer import make_trainer
from .tiny import char_tokenizer, tiny_llama


def lora_policy(vocab: int, **plan):
    """A LoRA policy whose B matrices are random, so the adapters change the function."""
    policy = prepare_model(tiny_llama(vocab), MemoryPlan(lora=LoRA(r=4, alpha=8), **plan))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return policy


def test_merged_lora_computes_the_adapted_function_and_restores_the_stored_weights():
    tok = char_tokenizer()
    policy = lora_policy(len(tok))
    x = torch.randint(4, len(tok), (3, 11))
    bases = {n: p for n, p in policy.named_parameters() if "base_layer" in n}
    stored = {n: (p.data_ptr(), p.detach().clone()) for n, p in bases.items()}
    with torch.no_grad():
        adapted = policy(input_ids=x).logits
        with policy.disable_adapter():
            base = policy(input_ids=x).logits
        assert (adapted - base).abs().max() > 1e-2  # the adapters matter
        with merged_lora(policy):
            merged = policy(input_ids=x).logits
            assert all(p.data_ptr() != stored[n][0] for n, p in bases.items())  # swapped in, not written
        after = policy(input_ids=x).logits
    torch.testing.assert_close(merged, adapted, rtol=0, atol=1e-5)
    assert torch.equal(after, adapted)  # adapters on again
    for n, p in bases.items():
        assert p.data_ptr() == stored[n][0] and torch.equal(p.data, stored[n][1])


def test_weights_are_restored_when_the_block_raises():
    policy = lora_policy(len(char_tokenizer()))
    before = [p.data_ptr() for n, p in policy.named_parameters() if "base_layer" in n]
    with pytest.raises(RuntimeError, match="inside"), merged_lora(policy):
        raise RuntimeError("inside")
    assert [p.data_ptr() for n, p in policy.named_parameters() if "base_layer" in n] == before
    assert all(not layer.disable_adapters for layer in policy.modules() if hasattr(layer, "lora_A"))


def test_a_merged_sampler_draws_what_the_trained_policy_would():
    tok = char_tokenizer()
    policy = lora_policy(len(tok))
    prompts = [Prompt("7*8", "56"), Prompt("100-1", "99")]
    batches = []
    for merge in (False, True):
        sampler = HFSampler(policy, tok, template=PlainTemplate("Q:{question}\nA:"), max_completion_tokens=12,
                            temperature=0.7, merge_lora=merge)
        torch.manual_seed(0)
        batches.append(sampler.sample(prompts, group_size=4))
    plain, merged = batches
    assert torch.equal(plain.completion_ids, merged.completion_ids)
    with torch.no_grad():
        trainer = completion_logprobs(policy, merged.prompt_ids, merged.prompt_mask, merged.completion_ids,
                                      merged.completion_mask, temperature=0.7)
    torch.testing.assert_close(merged.sampler_logprobs, trainer, rtol=0, atol=1e-5)


def test_training_with_merged_sampling_takes_the_same_steps(tmp_path):
    histories = []
    for merge in (False, True):
        plan = MemoryPlan(lora=LoRA(r=4, alpha=8), micro_batch_size=8, merge_lora_for_sampling=merge)
        trainer = make_trainer(tmp_path / str(merge), memory=plan, learning_rate=5e-2)
        assert trainer.sampler.merge_lora is merge
        histories.append(trainer.train())
    plain, merged = histories
    assert [h["reward/mean"] for h in merged] == [h["reward/mean"] for h in plain]
    assert [h["grad_norm"] for h in merged] == pytest.approx([h["grad_norm"] for h in plain], rel=1e-4)


def test_unmergeable_models_are_refused():
    tok = char_tokenizer()
    with pytest.raises(ValueError, match="needs a peft LoRA model, got LlamaForCausalLM"):
        check_mergeable(tiny_llama(len(tok)))
    half = lora_policy(len(tok)).to(torch.bfloat16)
    with pytest.raises(ValueError, match="base weight is torch.bfloat16"):
        HFSampler(half, tok, merge_lora=True)
    qlora = prepare_model(tiny_llama(len(tok), hidden=64), MemoryPlan(lora=LoRA(r=4), quantization="nf4"))
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in qlora.modules())
    with pytest.raises(ValueError, match="base layer is a Linear4bit"):
        check_mergeable(qlora)


@pytest.mark.parametrize("plan", [dict(), dict(lora=LoRA(), dtype="bfloat16"),
                                  dict(lora=LoRA(), quantization="nf4")])
def test_the_plan_refuses_a_merge_that_would_not_be_exact(plan):
    with pytest.raises(ConfigError, match="merge_lora_for_sampling=True needs lora, dtype='float32'"):
        MemoryPlan(merge_lora_for_sampling=True, **plan)


def test_the_estimate_counts_one_copy_of_the_adapted_weights_while_sampling():
    shape = ModelShape(vocab=1000, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2,
                       tie_embeddings=True)
    work = Workload(prompts_per_step=2, group_size=4, prompt_tokens=16, completion_tokens=16)
    lora = LoRA(r=4, target_modules=["q_proj", "down_proj"])
    # on the CPU (the demo's recipe): a GPU's kept CUDA-graph decoder, which merging rules out, would differ
    plain = estimate_memory(shape, MemoryPlan(lora=lora), work, device="cpu")
    merged = estimate_memory(shape, MemoryPlan(lora=lora, merge_lora_for_sampling=True), work, device="cpu")
    # q_proj 64 x 64 and down_proj 128 x 64 in each of 2 layers, float32
    assert merged.parts["merged_weights"] == 2 * (64 * 64 + 128 * 64) * 4
    assert merged.phases["sampling"] - plain.phases["sampling"] == merged.parts["merged_weights"]
    assert merged.phases["training"] == plain.phases["training"]
