"""Low-VRAM plan parts: QLoRA (NF4 base), paged optimizers, activation offload, prompt sharing."""

import pytest
import torch

from grpo_engine import GRPOConfig, GRPOTrainer
from grpo_engine.config import ConfigError
from grpo_engine.logprobs import can_share_prompt, completion_logprobs
from grpo_engine.losses import ClippedSurrogate
from grpo_engine.memory import LoRA, MemoryPlan, build_optimizer, prepare_model
from grpo_engine.memory.apply import is_quantized_4bit, trainable_parameters
from grpo_engine.models import load_model
from grpo_engine.rewards import Reward
from grpo_engine.sampling.hf import HFSampler
from grpo_engine.types import Prompt
from tests.tiny import char_tokenizer, tiny_llama

bnb = pytest.importorskip("bitsandbytes")


def grouped_batch(vocab: int, groups: int = 2, group_size: int = 3, prompt_len: int = 6,
                  completion_len: int = 5):
    """Rows b*G .. b*G+G-1 share prompt b; prompt 0 is left-padded, completions have ragged masks."""
    g = torch.Generator().manual_seed(3)
    pid = torch.randint(4, vocab, (groups, prompt_len), generator=g).repeat_interleave(group_size, 0)
    pmask = torch.ones_like(pid, dtype=torch.bool)
    pmask[:group_size, :2] = False
    pid = pid.masked_fill(~pmask, 0)
    cid = torch.randint(4, vocab, (groups * group_size, completion_len), generator=g)
    cmask = torch.ones_like(cid, dtype=torch.bool)
    cmask[1, 3:] = False
    cmask[4, 1:] = False
    return pid, pmask, cid.masked_fill(~cmask, 0), cmask


def lora_model(vocab: int, **plan) -> torch.nn.Module:
    model = prepare_model(tiny_llama(vocab, hidden=32), MemoryPlan(lora=LoRA(r=4, alpha=8), **plan))
    for name, param in model.named_parameters():
        if "lora_B" in name:  # non-zero adapters, so the prompt's KV carries adapter gradients
            torch.nn.init.normal_(param, std=0.5)
    return model


# -- prompt sharing -------------------------------------------------------------------------------


def test_shared_prompt_pass_equals_the_full_pass_in_value_and_gradient():
    tok = char_tokenizer()
    model = lora_model(len(tok)).double()
    pid, pmask, cid, cmask = grouped_batch(len(tok))
    assert can_share_prompt(model, pid, pmask)
    weights = torch.randn(cid.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    results = []
    for share in (False, True):
        model.train()
        model.zero_grad()
        lp, ent = completion_logprobs(model, pid, pmask, cid, cmask, with_entropy=True, share_prompt=share)
        (lp.double() * weights).sum().backward()
        results.append((lp.detach(), ent.detach(), [p.grad.clone() for p in trainable_parameters(model)]))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent1, ent0, rtol=0, atol=1e-6)
    assert (lp0[~cmask] == 0).all() and (lp1[~cmask] == 0).all()
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert sum(float(g.abs().sum()) for g in g1 if g is not None) > 0


def test_prompt_sharing_runs_the_prompt_once_per_group(monkeypatch):
    tok = char_tokenizer()
    model = lora_model(len(tok))
    pid, pmask, cid, cmask = grouped_batch(len(tok), groups=2, group_size=3)
    decoder = model.get_decoder()
    rows_seen = []
    decoder.register_forward_pre_hook(lambda mod, args, kwargs: rows_seen.append(kwargs["input_ids"].shape),
                                      with_kwargs=True)
    completion_logprobs(model, pid, pmask, cid, cmask, share_prompt=True)
    # 2 prompts once, then 6 completions without their last token (it predicts nothing that is scored)
    assert rows_seen == [torch.Size([2, 6]), torch.Size([6, 4])]
    rows_seen.clear()
    completion_logprobs(model, pid, pmask, cid, cmask, share_prompt=False)
    assert rows_seen == [torch.Size([6, 10])]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_one_token_completions_match_the_whole_sequence_logits(compiled):
    # C = 1: the prompt's last position predicts the only token; no completion pass runs
    tok = char_tokenizer()
    model = lora_model(len(tok)).double()
    model.eval()
    pid, pmask, cid, _ = grouped_batch(len(tok), completion_len=1)
    cmask = torch.ones_like(cid, dtype=torch.bool)
    mask = torch.cat([pmask, cmask], dim=1).long()
    with torch.no_grad():
        logits = model(input_ids=torch.cat([pid, cid], dim=1), attention_mask=mask,
                       position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        want = torch.log_softmax(logits[:, pid.shape[1] - 1], dim=-1).gather(1, cid)
        for share in (False, True):
            got = completion_logprobs(model, pid, pmask, cid, cmask, share_prompt=share, compiled=compiled)
            assert got.shape == (6, 1)
            torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)


def test_prompt_sharing_is_off_where_it_cannot_apply():
    tok = char_tokenizer()
    pid, pmask, _, _ = grouped_batch(len(tok))
    checkpointed = lora_model(len(tok), gradient_checkpointing=True)
    checkpointed.train()
    assert not can_share_prompt(checkpointed, pid, pmask)  # transformers keeps no cache there
    checkpointed.eval()
    # no-grad passes (old / reference log-probs) still share
    assert can_share_prompt(checkpointed, pid, pmask)
    distinct = torch.arange(12).reshape(2, 6)
    assert not can_share_prompt(checkpointed, distinct, torch.ones_like(distinct, dtype=torch.bool))


def test_sampler_with_a_shared_prefill_draws_the_same_completions():
    tok = char_tokenizer()
    model = tiny_llama(len(tok))
    prompts = [Prompt("What is 12+7?", "19"), Prompt("Hi", "x")]  # different lengths: left padding
    batches = []
    for share in (False, True):
        sampler = HFSampler(model, tok, max_completion_tokens=8, share_prompt=share)
        torch.manual_seed(0)
        batches.append(sampler.sample(prompts, group_size=4))
    a, b = batches
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_mask, b.completion_mask)
    torch.testing.assert_close(b.sampler_logprobs, a.sampler_logprobs, rtol=0, atol=1e-5)
    assert len(set(a.texts)) > 2  # the rows really were sampled, not copied


# -- QLoRA ----------------------------------------------------------------------------------------


def test_quantization_needs_lora():
    with pytest.raises(ConfigError, match="quantization='nf4' needs lora"):
        MemoryPlan(quantization="nf4")


def test_qlora_quantizes_every_linear_but_the_head_and_trains_fp32_adapters():
    tok = char_tokenizer()
    base = tiny_llama(len(tok), hidden=64)
    x = torch.randint(4, len(tok), (2, 9))
    model = prepare_model(tiny_llama(len(tok), hidden=64), MemoryPlan(lora=LoRA(r=4), quantization="nf4"))
    assert is_quantized_4bit(model)
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert type(model.get_output_embeddings()) is torch.nn.Linear
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert all(p.dtype == torch.float32 for p in trainable_parameters(model))
    # the 4-bit layer computes x @ dequant(W)^T exactly, and dequant(W) is within NF4's error of W
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    w = bnb.functional.dequantize_4bit(q_proj.weight.data, q_proj.weight.quant_state)
    h = torch.randn(3, 64)
    torch.testing.assert_close(q_proj(h), h @ w.T, rtol=1e-5, atol=1e-5)
    w0 = base.model.layers[0].self_attn.q_proj.weight
    # NF4's widest gap (-1 to -0.696) is 0.304 of a block's absmax: error <= half of it (+ scale rounding)
    assert 0 < (w - w0).abs().max() <= 0.16 * w0.abs().max()
    with torch.no_grad():  # B = 0 at init: the policy is the quantised base
        torch.testing.assert_close(model(x).logits, base(x).logits, rtol=0, atol=0.1)
    model.train()
    model(x).logits.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable_parameters(model))


def test_load_model_quantizes_while_loading_and_the_plan_must_agree(tmp_path):
    tok = char_tokenizer()
    tiny_llama(len(tok), hidden=64).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    plan = MemoryPlan(lora=LoRA(r=4), quantization="nf4")
    model, _ = load_model(tmp_path, plan=plan)
    assert is_quantized_4bit(model)
    with pytest.raises(ValueError, match="loaded in 4 bits but the MemoryPlan has quantization=None"):
        prepare_model(model, MemoryPlan(lora=LoRA(r=4)))
    policy = prepare_model(model, plan)
    assert isinstance(policy.base_model.model.model.layers[0].mlp.down_proj.base_layer, bnb.nn.Linear4bit)


class CharSum(Reward):
    name = "char_sum"

    def score(self, prompt: Prompt, completion: str) -> float:
        return float(sum(map(ord, completion)) % 3)  # varies with the content, not only the length


def test_a_qlora_step_with_the_adapter_disabled_reference_and_a_paged_8bit_optimizer():
    tok = char_tokenizer()
    plan = MemoryPlan(lora=LoRA(r=4), quantization="nf4", optimizer="paged_adamw8bit", micro_batch_size=4)
    config = GRPOConfig(prompts_per_step=2, group_size=4, max_completion_tokens=6, seed=0)
    trainer = GRPOTrainer(tiny_llama(len(tok), hidden=64), [CharSum()],
                          [Prompt("ab", None), Prompt("cd", None)],
                          config=config, memory=plan, tokenizer=tok, loss=ClippedSurrogate(kl_coef=0.1))
    assert trainer.reference is not None and isinstance(trainer.optimizer, bnb.optim.PagedAdamW8bit)
    before = [p.detach().clone() for p in trainable_parameters(trainer.model)]
    metrics = trainer.step()
    assert metrics["kl"] >= 0
    moved = sum(float((p - b).abs().sum()) for p, b in zip(trainable_parameters(trainer.model), before))
    assert moved > 0


# -- optimizers -----------------------------------------------------------------------------------


def test_paged_adamw_takes_the_same_step_as_torch_adamw():
    torch.manual_seed(0)
    start = torch.randn(64, 32)
    grads = [torch.randn(64, 32) for _ in range(3)]
    params = {}
    for name in ("adamw", "paged_adamw"):
        p = torch.nn.Parameter(start.clone())
        holder = torch.nn.Linear(1, 1)
        holder.weight = p
        holder.bias = None
        opt = build_optimizer(holder, MemoryPlan(optimizer=name), learning_rate=1e-2, weight_decay=0.1)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        params[name] = p.detach()
    assert isinstance(opt, bnb.optim.PagedAdamW)
    assert (params["adamw"] - start).abs().max() > 1e-3
    torch.testing.assert_close(params["paged_adamw"], params["adamw"], rtol=1e-5, atol=1e-6)


# -- activation offload ---------------------------------------------------------------------------


def test_offloaded_activations_give_the_same_gradients_and_go_through_the_hooks(monkeypatch):
    packed = []

    class Counting(torch.autograd.graph.saved_tensors_hooks):
        def __init__(self, pin_memory=False):
            super().__init__(lambda t: packed.append(1) or t, lambda t: t)

    tok = char_tokenizer()
    prompts = [Prompt("ab", None), Prompt("cde", None)]
    grads = []
    for offload in (False, True):
        if offload:
            monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Counting)
        plan = MemoryPlan(lora=LoRA(r=4), offload_activations=offload, micro_batch_size=4)
        trainer = GRPOTrainer(tiny_llama(len(tok)), [CharSum()], prompts, tokenizer=tok, memory=plan,
                              config=GRPOConfig(prompts_per_step=2, group_size=4, max_completion_tokens=6,
                                                seed=0))
        torch.manual_seed(1)
        batch = trainer.sampler.sample(prompts, group_size=4)
        advantages = torch.linspace(-1, 1, 8)
        trainer.compute_gradients(batch, advantages)
        grads.append([p.grad.clone() for p in trainable_parameters(trainer.model)])
    assert packed  # the offload hooks saw the saved activations
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
