"""compile_training: the training pass through compiled decoder layers gives the eager pass's numbers."""

import pytest
import torch

from grpo_engine import GRPOConfig, GRPOTrainer
from grpo_engine.compiling import compiled_layers
from grpo_engine.logprobs import completion_logprobs
from grpo_engine.memory import LoRA, MemoryPlan, prepare_model
from grpo_engine.memory.apply import trainable_parameters
from grpo_engine.rewards import Reward
from grpo_engine.types import Prompt
from tests.test_low_vram import grouped_batch
from tests.tiny import char_tokenizer, tiny_llama


def _lora(vocab: int, dtype: torch.dtype = torch.float64, **plan) -> torch.nn.Module:
    model = prepare_model(tiny_llama(vocab, hidden=32), MemoryPlan(lora=LoRA(r=4, alpha=8), **plan))
    for name, param in model.named_parameters():
        if "lora_B" in name:  # non-zero adapters: the prompt's keys and values carry adapter gradients
            torch.nn.init.normal_(param, std=0.5)
    return model.to(dtype)


def _pass(model, batch, weights, *, compiled: bool, share: bool):
    model.train()
    model.zero_grad()
    lp, ent = completion_logprobs(model, *batch, with_entropy=True, share_prompt=share, compiled=compiled)
    (lp.double() * weights).sum().backward()
    return lp.detach(), ent.detach(), [p.grad.clone() for p in trainable_parameters(model)]


# eager attention in float32: transformers' own eager pass gives NaN in a float64 model with left padding
# (a fully masked padding query row), which the reference would then carry
@pytest.mark.parametrize(("share", "attention", "dtype"), [
    (True, "sdpa", torch.float64), (False, "sdpa", torch.float64), (True, "eager", torch.float32)],
    ids=["prompt-shared", "whole-rows", "prompt-shared-eager-attention-float32"])
def test_compiled_layers_give_the_eager_log_probs_and_gradients(share, attention, dtype):
    # prompt 0 left-padded, completions of ragged lengths; LoRA on every linear layer of the compiled layers
    tok = char_tokenizer()
    model = _lora(len(tok), dtype)
    model.config._attn_implementation = attention  # eager attention takes an additive mask
    tolerance = 1e-5 if dtype == torch.float64 else 1e-4
    batch = grouped_batch(len(tok))
    weights = torch.randn(batch[2].shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    lp0, ent0, g0 = _pass(model, batch, weights, compiled=False, share=share)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    lp1, ent1, g1 = _pass(model, batch, weights, compiled=True, share=share)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs or share is False  # it compiled
    # float32 agreement, not float64's: the log-probs come out in float32 from both paths, and transformers'
    # RMSNorm computes in float32 inside a float64 model, where fused kernels sum in another order
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=tolerance / 10)
    torch.testing.assert_close(ent1, ent0, rtol=0, atol=tolerance / 10)
    assert (lp1[~batch[3]] == 0).all()
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, rtol=0, atol=tolerance * float(a.abs().max()))
    assert sum(float(g.abs().sum()) for g in g1) > 0
    # outside the pass the layers are the eager ones again
    assert all("forward" not in vars(layer) for layer in model.get_decoder().layers)
    assert model.config._attn_implementation == attention


def test_a_layer_with_a_patched_forward_is_refused_by_name():
    tok = char_tokenizer()
    model = tiny_llama(len(tok))
    layer = model.get_decoder().layers[1]
    layer.forward = layer.forward  # what accelerate's hooks leave on the instance
    with pytest.raises(ValueError, match=r"decoder layers \[1\].*device_map.*compile_training=False"):
        with compiled_layers(model):
            pass
    assert "forward" not in vars(model.get_decoder().layers[0])


class _Length(Reward):
    def score(self, prompt, completion):
        return float(len(completion) % 3)


def _trainer(tmp_path, compiled: bool, **plan) -> GRPOTrainer:
    tok = char_tokenizer()
    config = GRPOConfig(prompts_per_step=2, group_size=3, max_completion_tokens=6, max_prompt_tokens=16,
                        max_steps=2, seed=3, learning_rate=1e-3, output_dir=str(tmp_path / str(compiled)),
                        progress_bar=False)
    memory = MemoryPlan(micro_batch_size=3, compile_training=compiled, **plan)
    prompts = [Prompt(q) for q in ("ab", "abc", "b", "ca")]
    return GRPOTrainer(tiny_llama(len(tok)), [_Length()], prompts, config, memory, tokenizer=tok)


@pytest.mark.parametrize("plan", [{}, {"gradient_checkpointing": True}], ids=["plain", "checkpointed"])
def test_the_trainer_with_compile_training_takes_the_eager_steps(tmp_path, plan):
    runs = []
    for compiled in (False, True):  # one after the other: a trainer seeds torch's generator when built
        trainer = _trainer(tmp_path, compiled, **plan)
        runs.append(([trainer.step() for _ in range(2)], list(trainer.model.parameters())))
    (eager_steps, eager_weights), (steps, weights) = runs
    for a, b in zip(eager_steps, steps):
        for key in ("loss", "reward/mean", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert any(step["grad_norm"] > 0 for step in steps)  # the steps moved the weights
    for p, q in zip(eager_weights, weights):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-5)


@pytest.mark.parametrize("plan", [{"lora": LoRA(r=4), "quantization": "nf4"}, {"sharding": "fsdp"}])
def test_compile_training_refuses_what_it_does_not_support_yet(plan):
    with pytest.raises(ValueError, match="compile_training=True with .*set compile_training=False"):
        MemoryPlan(compile_training=True, **plan)
