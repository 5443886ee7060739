"""The vocabulary-tiled lm_head pass equals the naive full-softmax computation, in value and gradient."""

import contextlib
import copy

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


def _bf16_case(seed: int = 0):
    """Logits of magnitude ~10 (where bfloat16's spacing is 1/16) over 300 entries in tiles of 64."""
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(32, 300, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(300, 32, generator=g) * 0.6)
        head.bias.copy_(torch.randn(300, generator=g))
    hidden = torch.randn(9, 32, generator=g)
    targets = torch.randint(0, 300, (9,), generator=g)
    return head, hidden, targets, torch.randn(9, generator=g)


def _grads(head, hidden, targets, upstream, *, autocast: bool, weights_dtype=torch.float32):
    head = copy.deepcopy(head).to(weights_dtype)
    hidden = hidden.detach().to(weights_dtype).clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        lp, _ = tiled_linear_logprobs(hidden, head, targets, temperature=0.8, vocab_tile=64)
    (lp.float() * upstream).sum().backward()
    return lp.float(), [hidden.grad.float(), head.weight.grad.float(), head.bias.grad.float()]


@pytest.mark.parametrize("autocast,weights_dtype", [(True, torch.float32), (False, torch.bfloat16)])
def test_bfloat16_output_layer_gradients_match_fp64_within_bfloat16_tolerance(autocast, weights_dtype):
    # Mixed precision (float32 weights under bfloat16 autocast) and plain bfloat16 weights: the matmuls run in
    # bfloat16, the softmax and the sums over tiles in float32; the fp64 reference uses the same weights.
    head, hidden, targets, upstream = _bf16_case()
    lp, got = _grads(head, hidden, targets, upstream, autocast=autocast, weights_dtype=weights_dtype)
    ref = copy.deepcopy(head).to(weights_dtype).double()  # the same (rounded) weights, in fp64
    h64 = hidden.detach().to(weights_dtype).double().requires_grad_(True)
    want_lp, _ = naive(h64, ref.weight, ref.bias, targets, 0.8)
    (want_lp * upstream.double()).sum().backward()
    want = [h64.grad, ref.weight.grad, ref.bias.grad]
    assert (lp.double() - want_lp).abs().max() < 0.1  # logits of ~10 rounded to 1/16 (x 1/0.8)
    for a, b in zip(got, want):
        scale = b.abs().max()
        assert (a.double() - b).abs().max() <= 0.03 * scale, (a.double() - b).abs().max() / scale


def test_under_autocast_the_backward_softmax_agrees_with_the_forward_normaliser():
    # d log p(y) / d z = onehot(y) - softmax(z) sums to 0 over the vocabulary for each row only when the
    # backward pass recomputes the logits the forward pass normalised: the bias gradient sums to 0. Logits
    # recomputed in float32 against a bfloat16 forward's normaliser leave a sum of order 1e-2 per row.
    head, hidden, targets, _ = _bf16_case(1)
    _, (_, _, grad_bias) = _grads(head, hidden, targets, torch.ones(9), autocast=True)
    assert abs(float(grad_bias.sum())) < 1e-4 * 9


def _two_micro_batches(model, into_grad: bool, tile: int = 7) -> list[torch.Tensor]:
    """Full fine-tuning gradients of two accumulated micro-batches through the tiled head."""
    from grpo_engine.vocab_tiled import gradients_into_grad

    model.zero_grad(set_to_none=True)
    for seed in (0, 1):
        with gradients_into_grad(model) if into_grad else contextlib.nullcontext():
            lp = completion_logprobs(model, *batch(seed), vocab_tile=tile)
        (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("tile", [7, 64], ids=["tiles", "one-tile"])
@pytest.mark.parametrize("tied", [False, True])
def test_gradients_written_into_grad_equal_autograds(tied, tile):
    """Inside gradients_into_grad the head's and the embedding's weight gradients are added into .grad by
    their own backward (autograd is given none: torch.autograd.grad sees no path to them), and two
    accumulated micro-batches give autograd's gradients; the embedding's padding row (id 0) gets none from
    the lookup, as nn.Embedding's (untied: none at all). With one tile the first micro-batch's head
    gradient becomes .grad itself (tied: before the embedding's rows are added into it)."""
    from grpo_engine.vocab_tiled import gradients_into_grad

    model = tiny_llama(V, seed=3)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.embed_tokens.padding_idx = 0
    want = _two_micro_batches(copy.deepcopy(model), into_grad=False, tile=tile)
    got = _two_micro_batches(model, into_grad=True, tile=tile)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert tied or float(got[0][0].abs().max()) == 0.0  # the embedding's padding row
    assert "forward" not in vars(model.model.embed_tokens)  # the patch is gone after the context
    with gradients_into_grad(model):
        lp = completion_logprobs(model, *batch(), vocab_tile=7)
    weights = [model.model.embed_tokens.weight, model.lm_head.weight]
    assert torch.autograd.grad(lp.sum(), weights, allow_unused=True) == (None, None)


def test_inside_gradients_into_grad_no_vocabulary_sized_gradient_buffer_is_made():
    """The point of writing into .grad: the backward of a second micro-batch (tied embeddings, .grad
    already there) allocates no tensor of the [V, H] weight's shape (views of the weight and of .grad
    aside); outside the context autograd makes them (the head's, the embedding's, their sum)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from grpo_engine.vocab_tiled import gradients_into_grad

    class Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []  # (shape, storage) of every op's outputs

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            leaves = torch.utils._pytree.tree_leaves(out)
            self.made += [(t.shape, t.untyped_storage().data_ptr())
                          for t in leaves if isinstance(t, torch.Tensor)]
            return out

    def full_size_buffers(into_grad: bool) -> int:
        model = tiny_llama(V, seed=3)
        model.lm_head.weight = model.model.embed_tokens.weight
        weight = model.lm_head.weight
        for seed in (0, 1):
            with gradients_into_grad(model) if into_grad else contextlib.nullcontext():
                lp = completion_logprobs(model, *batch(seed), vocab_tile=7)  # tiles of [7, H]
            sizes = Sizes()
            with sizes:
                lp.sum().backward()
        mine = {weight.untyped_storage().data_ptr(), weight.grad.untyped_storage().data_ptr()}
        return sum(shape == weight.shape and storage not in mine for shape, storage in sizes.made)

    assert full_size_buffers(into_grad=False) >= 2
    assert full_size_buffers(into_grad=True) == 0


@pytest.mark.parametrize("into_grad", [False, True])
def test_one_tile_backward_zeroes_no_gradient_buffer(into_grad):
    """With the vocabulary in one tile the backward's sums are single products: it zeroes no buffer for the
    hidden states' or the weight's gradient (with 3 tiles it zeroes both), and the gradients equal the
    fp64 reference's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from grpo_engine.vocab_tiled import gradients_into_grad

    class Zeroed(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            aten = torch.ops.aten
            if func in (aten.zeros.default, aten.zero_.default, aten.fill_.Scalar, aten.zeros_like.default,
                        aten.new_zeros.default):
                self.shapes.append(tuple(out.shape))
            return out

    g = torch.Generator().manual_seed(8)
    hidden0, upstream = torch.randn(5, 6, generator=g), torch.randn(5, generator=g)
    targets = torch.tensor([0, 3, 10, 7, 3])
    head = torch.nn.Linear(6, 11, bias=False)

    def zeroed(tile: int):
        head.zero_grad(set_to_none=True)
        hidden = hidden0.clone().requires_grad_(True)
        with gradients_into_grad(head) if into_grad else contextlib.nullcontext():
            lp, _ = tiled_linear_logprobs(hidden, head, targets, vocab_tile=tile, keep_logits=True)
        with Zeroed() as mode:
            (lp * upstream).sum().backward()
        return mode.shapes, hidden.grad, head.weight.grad

    shapes, grad_hidden, grad_weight = zeroed(tile=16)
    assert (5, 6) not in shapes and (11, 6) not in shapes
    reference = hidden0.clone().requires_grad_(True)
    weight = head.weight.detach().clone().requires_grad_(True)
    (naive(reference, weight, None, targets, 1.0)[0].float() * upstream).sum().backward()
    torch.testing.assert_close(grad_hidden, reference.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_weight, weight.grad, rtol=1e-5, atol=1e-6)
    shapes = zeroed(tile=4)[0]
    assert (5, 6) in shapes and (11, 6) in shapes


def _counted_tile_logits(monkeypatch) -> list[int]:
    """Counts the tiles' logit products (``_tile_logits`` calls) of the tiled pass."""
    import grpo_engine.vocab_tiled as vt

    calls, plain = [0], vt._tile_logits

    def counted(*args, **kwargs):
        calls[0] += 1
        return plain(*args, **kwargs)

    monkeypatch.setattr(vt, "_tile_logits", counted)
    return calls


@pytest.mark.parametrize("temperature,with_bias", [(1.0, False), (0.7, True)])
def test_kept_logits_give_the_recomputed_gradients_bit_for_bit_with_one_product_fewer(
        monkeypatch, temperature, with_bias):
    """One tile (11 entries, tile 16): the kept logits are the ones the backward pass recomputes, so the
    log-probs and every gradient are equal bit for bit, and the backward pass makes no logits of its own;
    with 3 tiles nothing is kept (the forward's 3 products, then the backward's 3)."""
    calls = _counted_tile_logits(monkeypatch)
    g = torch.Generator().manual_seed(5)
    head = torch.nn.Linear(6, 11, bias=with_bias)
    hidden0 = torch.randn(5, 6, generator=g)
    targets, upstream = torch.tensor([0, 3, 10, 7, 3]), torch.randn(5, generator=g)

    def run(keep: bool, tile: int = 16):
        head.zero_grad(set_to_none=True)
        hidden = hidden0.clone().requires_grad_(True)
        calls[0] = 0
        lp, _ = tiled_linear_logprobs(hidden, head, targets, temperature=temperature, vocab_tile=tile,
                                      keep_logits=keep)
        forward = calls[0]
        (lp * upstream).sum().backward()
        grads = [hidden.grad, head.weight.grad] + ([head.bias.grad] if with_bias else [])
        return lp.detach(), grads, (forward, calls[0] - forward)

    lp_kept, kept, kept_calls = run(keep=True)
    lp_plain, plain, plain_calls = run(keep=False)
    assert torch.equal(lp_kept, lp_plain)
    assert all(torch.equal(a, b) for a, b in zip(kept, plain, strict=True))
    assert (kept_calls, plain_calls) == ((1, 0), (1, 1))
    assert run(keep=True, tile=4)[2] == (3, 3)  # 3 tiles: the logits are recomputed


def test_a_second_backward_through_kept_logits_recomputes_them(monkeypatch):
    """The backward pass turns the kept logits into the gradient in place; a second backward through the
    same graph (retain_graph) recomputes them and adds the same gradient again."""
    calls = _counted_tile_logits(monkeypatch)
    head = torch.nn.Linear(6, 11, bias=False)
    hidden = torch.randn(5, 6, generator=torch.Generator().manual_seed(6), requires_grad=True)
    lp, _ = tiled_linear_logprobs(hidden, head, torch.tensor([0, 3, 10, 7, 3]), keep_logits=True)
    lp.sum().backward(retain_graph=True)
    first = head.weight.grad.clone()
    lp.sum().backward()
    assert calls[0] == 2  # the forward's product, then the second backward's
    torch.testing.assert_close(head.weight.grad, 2 * first, rtol=0, atol=0)


def test_logits_are_kept_only_for_tokens_in_one_chunk(monkeypatch):
    """``selective_logprobs(keep_logits=True)`` keeps a chunk's logits only when the tokens make one chunk:
    with several, each chunk's would stay alive until the backward pass, past the chunk x tile bound."""
    from grpo_engine.logprobs import selective_logprobs

    calls = _counted_tile_logits(monkeypatch)
    head = torch.nn.Linear(6, 11, bias=False)
    hidden = torch.randn(8, 6, generator=torch.Generator().manual_seed(7), requires_grad=True)
    targets = torch.arange(8)
    for chunk, backward_products in ((8, 0), (4, 2)):
        lp = selective_logprobs(hidden, head, targets, chunk_size=chunk, vocab_tile=16, keep_logits=True)
        calls[0] = 0
        lp.sum().backward()
        assert calls[0] == backward_products, chunk
