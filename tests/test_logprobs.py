"""Chunked completion log-probs equal the naive full-logits computation, in value and gradient."""

import pytest
import torch

from grpo_engine.logprobs import completion_logprobs, position_ids_from_mask, selective_logprobs
from tests.tiny import tiny_llama

V = 40


def batch(seed=0):
    """Three rows: left-padded prompts of lengths 4, 2, 3 and completions of lengths 5, 1, 3."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(4, V, (3, 4), generator=g)
    prompt_mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    prompt_ids[~prompt_mask] = 0
    completion_ids = torch.randint(4, V, (3, 5), generator=g)
    completion_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    completion_ids[~completion_mask] = 0
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def naive(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature):
    """The textbook computation: full [n, T, V] logits from model(...), log-softmax, gather."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1).long()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    logits = logits[:, prompt_ids.shape[1] - 1:-1].double() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, completion_ids[..., None]).squeeze(-1)
    return torch.where(completion_mask, lp, torch.zeros((), dtype=lp.dtype))


@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_naive_value_and_gradient(chunk_size, temperature):
    model = tiny_llama(V)
    inputs = batch()
    got = completion_logprobs(model, *inputs, temperature=temperature, chunk_size=chunk_size)
    want = naive(model, *inputs, temperature)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)
    assert (got[~inputs[3]] == 0).all()

    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
    (got * weights).sum().backward()
    grads_chunked = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (naive(model, *inputs, temperature).float() * weights).sum().backward()
    for g1, p in zip(grads_chunked, model.parameters()):
        torch.testing.assert_close(g1, p.grad, rtol=1e-4, atol=1e-6)


def test_lora_on_lm_head_matches_naive():
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    model = get_peft_model(tiny_llama(V), config)
    inputs = batch(2)
    got = completion_logprobs(model, *inputs, chunk_size=2)
    torch.testing.assert_close(got.double(), naive(model, *inputs, 1.0), rtol=0, atol=2e-6)
    got.sum().backward()
    head_a = model.base_model.model.lm_head.lora_A["default"].weight
    assert head_a.grad is not None and head_a.grad.abs().sum() > 0


def test_a_row_does_not_depend_on_its_neighbours_padding():
    model = tiny_llama(V)
    p_ids, p_mask, c_ids, c_mask = batch()
    together = completion_logprobs(model, p_ids, p_mask, c_ids, c_mask)
    # row 1 alone, without the padding columns the batch forced on it
    alone = completion_logprobs(model, p_ids[1:2, 2:], p_mask[1:2, 2:], c_ids[1:2, :1], c_mask[1:2, :1])
    torch.testing.assert_close(together[1, :1], alone[0], rtol=0, atol=1e-6)


def test_selective_logprobs_hand_case():
    """Identity head over 2 classes: hidden [0, ln 3] gives logits [0, ln 3], so p(1) = 3/4, p(0) = 1/4."""
    head = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(2))
    hidden = torch.tensor([[0.0, torch.log(torch.tensor(3.0))]] * 2)
    got = selective_logprobs(hidden, head, torch.tensor([1, 0]), chunk_size=1)
    torch.testing.assert_close(got, torch.log(torch.tensor([0.75, 0.25])))
    with pytest.raises(ValueError, match="chunk_size=0"):
        selective_logprobs(hidden, head, torch.tensor([1, 0]), chunk_size=0)


def test_token_entropy_equals_the_full_softmax_value_with_gradient():
    model = tiny_llama(V)
    inputs = batch(3)
    lp, ent = completion_logprobs(model, *inputs, temperature=0.8, chunk_size=2, with_entropy=True)
    ids = torch.cat([inputs[0], inputs[2]], 1)
    mask = torch.cat([inputs[1], inputs[3]], 1).long()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    p = torch.softmax(logits[:, inputs[0].shape[1] - 1:-1].double() / 0.8, -1)
    want = torch.where(inputs[3], -(p * p.log()).sum(-1), torch.zeros((), dtype=torch.float64))
    torch.testing.assert_close(ent.double(), want, rtol=0, atol=2e-6)
    torch.testing.assert_close(lp, completion_logprobs(model, *inputs, temperature=0.8))
    ent.sum().backward()
    assert model.lm_head.weight.grad.abs().sum() > 0
