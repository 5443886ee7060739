"""The compiled decoding step with its linear products compiled as reductions
(grpo_engine.sampling.compiled_products): the product equals F.linear within float32 rounding, eager code
keeps F.linear exactly, the compiled step traces every layer through the reduction, draws the eager tokens
and reuses its graph, a trainer takes the same steps, and the refusals."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from grpo_engine import MemoryPlan
from grpo_engine.config import ConfigError
from grpo_engine.data import PlainTemplate
from grpo_engine.sampling import compiled_products as products
from grpo_engine.sampling.hf import HFSampler
from grpo_engine.sampling.static import decode_static

from .test_trainer import make_trainer
from .tiny import char_tokenizer, static_decode_case, tiny_llama

pytestmark = pytest.mark.skipif(not products.compiled_products_available(),
                                reason="this torch lacks inductor_force_stride_order")


@pytest.mark.parametrize("shape", [(5, 24), (2, 3, 24), (4, 1, 24), (40, 24), (3, 12, 24)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_reduction_computes_f_linear(shape, bias):
    torch.manual_seed(0)
    layer = nn.Linear(24, 40, bias=bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        out = products.product_as_reduction(x, layer.weight, layer.bias)
        expected = F.linear(x.double(), layer.weight.double(),
                            None if layer.bias is None else layer.bias.double())
    assert out.shape == (*shape[:-1], 40) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)


def test_only_compiled_code_changes_and_the_layers_are_restored():
    tok = char_tokenizer()
    model = tiny_llama(len(tok), hidden=64)
    extra = nn.ModuleList([nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8)])
    model.extra = extra  # a bfloat16 layer is left alone; a layer with its own forward too
    extra[1].forward = lambda x: x
    x = torch.randint(4, len(tok), (3, 9))
    layers = [m for m in model.modules() if type(m) is nn.Linear]
    with torch.no_grad():
        plain = model(input_ids=x).logits
        with products.compiled_products(model) as count:
            assert count == 2 * 7 + 1  # q k v o gate up down per layer, and the head
            with products.compiled_products(model) as inner:  # nested: nothing changed twice
                assert inner == 0
            eager = model(input_ids=x).logits
    assert torch.equal(eager, plain)  # eager code runs F.linear as before
    assert "forward" in vars(extra[1]) and all("forward" not in vars(m) for m in layers if m is not extra[1])


@pytest.mark.parametrize("rows,sums", [(6, 6), (products.UNROLLED_ROWS, products.UNROLLED_ROWS),
                                       (products.UNROLLED_ROWS + 1, 1)])
def test_up_to_the_unrolled_rows_each_row_is_its_own_sum(rows, sums):
    """The traced product (what inductor compiles) sums each row on its own up to UNROLLED_ROWS rows, so
    that inductor fuses the sums into one loop with an accumulator per row; above, one sum."""
    from torch.fx.experimental.proxy_tensor import make_fx

    weight, x = torch.randn(40, 24), torch.randn(rows, 24)
    graph = make_fx(lambda x, w: products.product_as_reduction(x, w, None))(x, weight).graph
    assert sum(node.target == torch.ops.aten.sum.dim_IntList for node in graph.nodes) == sums
    compiled = torch.compile(products.product_as_reduction, dynamic=False)
    with torch.no_grad():
        out = compiled(x, weight, None)
    torch.testing.assert_close(out.double(), x.double() @ weight.double().T, rtol=1e-6, atol=1e-5)


def _matrix_products(code: list[str]) -> int:
    """The BLAS matrix products (not the attention's batched ones) that inductor's code calls."""
    text = "\n".join(code)
    return len(re.findall(r"aoti_torch_cpu_mm_out|extern_kernels\.mm\(", text))


def test_the_compiled_step_computes_the_products_as_reductions():
    """torch.compile of the step (about 10 s on 2 cores): two calls with compiled products, then one
    without, all drawing the eager tokens. The first compiles a step that calls no BLAS matrix product,
    the second reuses it, the third compiles one that calls one per layer."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    model, ids, mask, kw, eager = static_decode_case()
    outputs, codes, compiles = [], [], []
    for on, code_of_a_new_compile in ((True, True), (True, False), (False, True)):
        torch.manual_seed(0)
        before = counters["stats"]["unique_graphs"]
        with products.compiled_products(model) if on else torch.no_grad():
            if code_of_a_new_compile:  # run_and_get_code resets dynamo: it compiles anew
                out, code = run_and_get_code(decode_static, model, ids, mask, mode="compiled", **kw)
                codes.append(code)
            else:
                out = decode_static(model, ids, mask, mode="compiled", **kw)
        outputs.append(out)
        compiles.append(counters["stats"]["unique_graphs"] - before)
    assert len(codes[0]) == 1 and _matrix_products(codes[0]) == 0  # the 15 layers' products are loops
    assert compiles[1] == 0  # the same graph again
    assert len(codes[1]) == 1 and _matrix_products(codes[1]) == 15  # q k v o gate up down x 2, the head
    for ids_out, logprobs in outputs:
        assert torch.equal(ids_out, eager[0])
        torch.testing.assert_close(logprobs, eager[1], rtol=0, atol=1e-5)


def test_training_with_compiled_products_takes_the_eager_steps(tmp_path):
    """The static path's eager step against its compiled step with compiled products (one compile)."""
    torch._dynamo.reset()
    histories = []
    for plan in (MemoryPlan(micro_batch_size=8, decoding="static"),
                 MemoryPlan(micro_batch_size=8, decoding="compiled", compiled_products_for_sampling=True)):
        trainer = make_trainer(tmp_path / plan.decoding, memory=plan, learning_rate=5e-2)
        assert trainer.sampler.compiled_products is plan.compiled_products_for_sampling
        histories.append(trainer.train())
        assert trainer.sampler.last_decoding["path"] == plan.decoding
    eager, compiled = histories
    assert [h["reward/mean"] for h in compiled] == [h["reward/mean"] for h in eager]
    assert [h["grad_norm"] for h in compiled] == pytest.approx([h["grad_norm"] for h in eager], rel=1e-4)


def test_compiled_products_are_refused_where_they_cannot_run():
    compiled = dict(decoding="compiled")
    for plan in (dict(), dict(decoding="dynamic"), dict(compiled, pack_weights_for_sampling=True),
                 dict(compiled, dtype="bfloat16"), dict(compiled, compute_dtype="bfloat16"),
                 dict(compiled, sharding="fsdp")):
        with pytest.raises(ConfigError, match="it changes the compiled decoding step of float32 weights"):
            MemoryPlan(compiled_products_for_sampling=True, **plan)
    tok = char_tokenizer()
    model = tiny_llama(len(tok))
    template = PlainTemplate("{question}")
    with pytest.raises(ValueError, match="decoding='auto' and pack_weights=False: it changes only the comp"):
        HFSampler(model, tok, template=template, compiled_products=True)
    with pytest.raises(ValueError, match="the model has no plain float32 nn.Linear; set compiled_pro"):
        HFSampler(model.to(torch.bfloat16), tok, template=template, decoding="compiled",
                  compiled_products=True)
