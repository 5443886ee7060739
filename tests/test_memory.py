"""MemoryPlan application: checkpointing keeps gradients exact, optimizers, reference policies."""

import torch

from grpo_engine.logprobs import completion_logprobs
from grpo_engine.memory import LoRA, MemoryPlan, build_optimizer, prepare_model
from grpo_engine.memory.apply import ReferencePolicy, trainable_parameters
from tests.test_logprobs import V, batch
from tests.tiny import tiny_llama


def loss_and_grads(model):
    model.train()
    lp = completion_logprobs(model, *batch(), chunk_size=4)
    lp.sum().backward()
    return lp.detach(), [p.grad.clone() for p in trainable_parameters(model)]


def test_gradient_checkpointing_gives_the_same_gradients():
    plain = prepare_model(tiny_llama(V), MemoryPlan())
    ckpt = prepare_model(tiny_llama(V), MemoryPlan(gradient_checkpointing=True))
    assert any(getattr(m, "gradient_checkpointing", False) for m in ckpt.modules())
    (lp1, g1), (lp2, g2) = loss_and_grads(plain), loss_and_grads(ckpt)
    torch.testing.assert_close(lp1, lp2, rtol=0, atol=1e-6)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_lora_with_checkpointing_trains_only_fp32_adapters():
    torch.manual_seed(0)
    model = prepare_model(tiny_llama(V), MemoryPlan(lora=LoRA(r=2, alpha=4), gradient_checkpointing=True,
                                                    dtype="bfloat16"))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert all(p.dtype == torch.float32 for p in trainable_parameters(model))
    assert next(p for n, p in model.named_parameters() if "embed_tokens" in n).dtype == torch.bfloat16
    _, grads = loss_and_grads(model)
    assert any(g.abs().sum() > 0 for g in grads)


def test_optimizers():
    model = prepare_model(tiny_llama(V), MemoryPlan(lora=LoRA(r=2)))
    adamw = build_optimizer(model, MemoryPlan(), learning_rate=1e-3)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["lr"] == 1e-3
    import bitsandbytes as bnb

    eight_bit = build_optimizer(model, MemoryPlan(optimizer="adamw8bit"), learning_rate=1e-3,
                                betas=(0.9, 0.95))
    assert isinstance(eight_bit, bnb.optim.AdamW8bit) and eight_bit.defaults["betas"] == (0.9, 0.95)


def test_dropout_is_switched_off():
    model = tiny_llama(V)
    model.model.layers[0].self_attn.attention_dropout = 0.5
    drop = torch.nn.Dropout(0.3)
    model.model.extra = drop
    prepare_model(model, MemoryPlan())
    assert drop.p == 0.0
    assert model.model.layers[0].self_attn.attention_dropout == 0.0


def test_full_finetune_reference_is_a_frozen_copy():
    policy = prepare_model(tiny_llama(V), MemoryPlan())
    ref = ReferencePolicy(policy, MemoryPlan())
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.1)
    with ref.active() as ref_model:
        assert ref_model is not policy
        assert all(not p.requires_grad for p in ref_model.parameters())
        fresh = tiny_llama(V)
        with torch.no_grad():
            torch.testing.assert_close(completion_logprobs(ref_model, *batch()),
                                       completion_logprobs(fresh, *batch()))
