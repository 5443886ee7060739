"""The vocabulary-tiled lm_head pass equals the naive full-softmax computation, in value and gradient."""

import pytest
import torch

from grpo_engine.logprobs import completion_logprobs
from grpo_engine.vocab_tiled import tiled_linear_logprobs
from tests.test_logprobs import V, batch
from tests.tiny import tiny_llama


def naive(hidden, weight, bias, targets, temperature):
    """fp64 reference: full logits, log-softmax, gather; entropy -sum p log p."""
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    logp = torch.log_softmax(z / temperature, -1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("tile", [1, 3, 7, 11, 1000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_tiled_equals_naive_value_entropy_and_gradients(tile, with_bias):
    g = torch.Generator().manual_seed(tile)
    head = torch.nn.Linear(6, 11, bias=with_bias)
    hidden = torch.randn(5, 6, generator=g, requires_grad=True)
    targets = torch.tensor([0, 3, 10, 7, 3])  # first, middle and last tiles
    lp, ent = tiled_linear_logprobs(hidden, head, targets, temperature=0.7, vocab_tile=tile)
    want_lp, want_ent = naive(hidden, head.weight, head.bias, targets, 0.7)
    torch.testing.assert_close(lp.double(), want_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), want_ent, rtol=0, atol=1e-5)
    assert ent.grad_fn is None  # the tiled entropy carries no gradient

    upstream = torch.randn(5, generator=g)
    (lp * upstream).sum().backward()
    got = [hidden.grad.clone(), head.weight.grad.clone()] + ([head.bias.grad.clone()] if with_bias else [])
    hidden.grad = None
    head.zero_grad()
    (naive(hidden, head.weight, head.bias, targets, 0.7)[0].float() * upstream).sum().backward()
    want = [hidden.grad, head.weight.grad] + ([head.bias.grad] if with_bias else [])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("tied", [False, True])
def test_model_logprobs_tiled_equal_untiled(tied):
    model = tiny_llama(V)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    inputs = batch(4)
    tiled = completion_logprobs(model, *inputs, temperature=0.9, chunk_size=4, vocab_tile=8)
    tiled.sum().backward()
    g_tiled = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    plain = completion_logprobs(model, *inputs, temperature=0.9, chunk_size=4)
    plain.sum().backward()
    torch.testing.assert_close(tiled, plain, rtol=0, atol=2e-6)
    for a, p in zip(g_tiled, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-6)


def test_entropy_with_gradient_uses_the_checkpointed_chunks():
    model = tiny_llama(V)
    _, ent = completion_logprobs(model, *batch(), with_entropy=True, vocab_tile=8, entropy_grad=True)
    assert ent.requires_grad
    _, ent = completion_logprobs(model, *batch(), with_entropy=True, vocab_tile=8)
    assert not ent.requires_grad
    with pytest.raises(ValueError, match="vocab_tile=0 must be >= 1"):
        tiled_linear_logprobs(torch.zeros(1, 2), torch.nn.Linear(2, 3), torch.tensor([0]), vocab_tile=0)
