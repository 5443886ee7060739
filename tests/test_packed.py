"""Sampling with packed linear weights (grpo_engine.sampling.packed): the same function within float32
rounding, the layers and weights restored, autograd falling back to F.linear, the same samples and
steps as unpacked sampling, the compiled decoding step calling the packed op without recompiling, and
the refusals and the memory estimate."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from grpo_engine import LoRA, MemoryPlan
from grpo_engine.config import ConfigError
from grpo_engine.data import PlainTemplate
from grpo_engine.memory.estimate import PACK_MIN, ModelShape, Workload, estimate_memory
from grpo_engine.sampling import packed
from grpo_engine.sampling.hf import HFSampler
from grpo_engine.sampling.static import decode_static
from grpo_engine.types import Prompt

from .test_trainer import make_trainer
from .tiny import char_tokenizer, static_decode_case, tiny_llama

pytestmark = pytest.mark.skipif(not packed.packing_available(), reason="this torch build has no oneDNN")


@pytest.fixture
def pack_everything(monkeypatch):
    """The tiny test models' layers are below the size worth packing: pack every layer."""
    monkeypatch.setattr(packed, "MIN_ELEMENTS", 1)


def test_packed_layers_compute_f_linear_and_are_restored(pack_everything):
    tok = char_tokenizer()
    model = tiny_llama(len(tok), hidden=64)
    x = torch.randint(4, len(tok), (3, 9))
    layers = [m for m in model.modules() if type(m) is nn.Linear]
    stored = [(m.weight.data_ptr(), m.weight.detach().clone()) for m in layers]
    with torch.no_grad():
        plain = model(input_ids=x).logits
        with packed.packed_linears(model, rows=3) as count:
            assert count == len(layers) == 2 * 7 + 1  # q k v o gate up down per layer, and the head
            assert all("forward" in vars(m) for m in layers)
            with packed.packed_linears(model, rows=3) as inner:  # nested: nothing packed twice
                assert inner == 0
            assert all("forward" in vars(m) for m in layers)
            inside = model(input_ids=x).logits
            # the layers read the packed copies: a zeroed copy of the head's weight zeroes the logits
            head = model.lm_head.weight
            zeros = torch.ops.mkldnn._reorder_linear_weight(torch.zeros_like(head), 3)
            packed._PACKED[head.data_ptr()] = zeros
            assert torch.equal(model(input_ids=x).logits, torch.zeros_like(plain))
    assert all("forward" not in vars(m) for m in layers)
    assert not packed._PACKED
    for m, (pointer, value) in zip(layers, stored):
        assert m.weight.data_ptr() == pointer and torch.equal(m.weight, value)
    torch.testing.assert_close(inside, plain, rtol=1e-5, atol=1e-5)


def test_only_large_plain_float32_linears_are_packed():
    small, large = nn.Linear(64, 64), nn.Linear(512, 256)  # 4,096 and 131,072 elements
    assert packed.MIN_ELEMENTS == PACK_MIN == 512 * 256
    half, hooked = nn.Linear(512, 256).to(torch.bfloat16), nn.Linear(512, 256)
    hooked.forward = lambda x: x
    model = nn.Sequential(small, large, half, hooked)
    assert packed.packable_layers(model) == [large]


def test_with_autograd_a_packed_layer_falls_back_to_f_linear(pack_everything):
    layer = nn.Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    with packed.packed_linears(layer, rows=4):
        y = layer(x)
    y.square().sum().backward()
    expected = F.linear(x, layer.weight, layer.bias)
    assert torch.equal(y, expected)  # F.linear itself ran
    assert layer.weight.grad is not None and x.grad is not None


def test_frozen_weights_are_packed_once_and_again_only_when_their_data_change(pack_everything, monkeypatch):
    frozen, trained = nn.Linear(16, 8), nn.Linear(8, 8)
    frozen.requires_grad_(False)
    model, x, keep, packs = nn.Sequential(frozen, trained), torch.randn(4, 16), {}, []
    reorder = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(packed.torch.ops.mkldnn, "_reorder_linear_weight",
                        lambda w, rows: packs.append(w.data_ptr()) or reorder(w, rows))

    def run() -> list[int]:
        packs.clear()
        with torch.no_grad():
            expected = model(x)
            with packed.packed_linears(model, rows=4, keep=keep):
                torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-6)
        return list(packs)

    assert run() == [frozen.weight.data_ptr(), trained.weight.data_ptr()]
    assert run() == [trained.weight.data_ptr()]  # the frozen copy was kept; the trained one packed again
    frozen.weight.data = frozen.weight.data + 1  # another tensor at the same version (as merged_lora swaps)
    assert run() == [frozen.weight.data_ptr(), trained.weight.data_ptr()]
    with torch.no_grad():
        frozen.weight.mul_(2)  # changed in place: the same storage, its version counter moves
    assert run() == [frozen.weight.data_ptr(), trained.weight.data_ptr()]
    assert run() == [trained.weight.data_ptr()]
    assert not packed._PACKED and list(keep) == [id(frozen.weight)]
    frozen.requires_grad_(True)  # now trained: its kept copy is dropped
    assert len(run()) == 2 and keep == {}


def test_a_lora_sampler_keeps_its_base_weights_packed_between_calls(pack_everything, monkeypatch):
    """Unmerged LoRA: the base weights are packed at the first call only, and every call draws the
    unpacked sampler's tokens; with merged adapters nothing is kept."""
    from peft import LoraConfig, get_peft_model

    tok = char_tokenizer()
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(tiny_llama(len(tok), hidden=64), config)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, std=0.1)
    prompts = [Prompt("7*8", "56"), Prompt("100-1", "99")]
    packs = []
    reorder = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(packed.torch.ops.mkldnn, "_reorder_linear_weight",
                        lambda w, rows: packs.append(1) or reorder(w, rows))
    kw = dict(template=PlainTemplate("Q:{question}\nA:"), max_completion_tokens=6, temperature=0.7)
    plain, kept, merged = (HFSampler(model, tok, **kw, pack_weights=pack, merge_lora=merge)
                           for pack, merge in ((False, False), (True, False), (True, True)))
    layers = len(packed.packable_layers(model))  # every linear of the base, the adapters' too
    for call in range(2):
        packs.clear()
        torch.manual_seed(call)
        expected = plain.sample(prompts, group_size=2)
        torch.manual_seed(call)
        got = kept.sample(prompts, group_size=2)
        assert torch.equal(got.completion_ids, expected.completion_ids)
        frozen = sum(1 for m in packed.packable_layers(model) if not m.weight.requires_grad)
        assert len(packs) == (layers if call == 0 else layers - frozen)
        assert 0 < frozen < layers
    assert merged._kept_packs is None


def test_a_packed_sampler_draws_the_unpacked_tokens(pack_everything):
    tok = char_tokenizer()
    model = tiny_llama(len(tok), hidden=64)
    prompts = [Prompt("7*8", "56"), Prompt("100-1", "99")]
    batches = []
    for pack in (False, True):
        sampler = HFSampler(model, tok, template=PlainTemplate("Q:{question}\nA:"), max_completion_tokens=12,
                            temperature=0.7, pack_weights=pack)
        torch.manual_seed(0)
        batches.append(sampler.sample(prompts, group_size=4))
    plain, packed_batch = batches
    assert torch.equal(plain.completion_ids, packed_batch.completion_ids)
    torch.testing.assert_close(packed_batch.sampler_logprobs, plain.sampler_logprobs, rtol=0, atol=1e-5)
    assert not packed._PACKED and all("forward" not in vars(m) for m in model.modules())


def test_the_compiled_step_calls_the_packed_op_without_recompiling(pack_everything, monkeypatch):
    """torch.compile of the step (about 30 s on 2 cores): two calls with packing, then one without,
    all drawing the eager tokens; the second packed call reuses the first call's graph."""
    from torch._dynamo.utils import counters

    model, ids, mask, kw, eager = static_decode_case()
    outputs, compiles, products = [], [], []
    product = packed._product
    monkeypatch.setattr(packed, "_product", lambda *args: products.append(1) or product(*args))
    for pack in (True, True, False):
        torch.manual_seed(0)
        before, products[:] = counters["stats"]["unique_graphs"], []
        with packed.packed_linears(model, rows=6) if pack else torch.no_grad():
            outputs.append(decode_static(model, ids, mask, mode="compiled", **kw))
        compiles.append(counters["stats"]["unique_graphs"] - before)
        # every one of the 15 layers reads its packed copy in the eager prefill and in the 8 compiled steps
        assert len(products) == (15 * (1 + 8) if pack else 0)
    for ids_out, logprobs in outputs:
        assert torch.equal(ids_out, eager[0])
        torch.testing.assert_close(logprobs, eager[1], rtol=0, atol=1e-5)
    assert compiles[1] == 0 and compiles[2] >= 1  # the same graph again; without packing another one


def test_training_with_packed_sampling_takes_the_same_steps(tmp_path, pack_everything):
    histories = []
    for pack in (False, True):
        plan = MemoryPlan(lora=LoRA(r=4, alpha=8), micro_batch_size=8, pack_weights_for_sampling=pack)
        trainer = make_trainer(tmp_path / str(pack), memory=plan, learning_rate=5e-2)
        assert trainer.sampler.pack_weights is pack
        histories.append(trainer.train())
    plain, packed_run = histories
    assert [h["reward/mean"] for h in packed_run] == [h["reward/mean"] for h in plain]
    assert [h["grad_norm"] for h in packed_run] == pytest.approx([h["grad_norm"] for h in plain], rel=1e-4)


def test_packing_is_refused_where_it_cannot_run():
    tok = char_tokenizer()
    with pytest.raises(ValueError, match="no plain float32 nn.Linear large enough to pack"):
        HFSampler(tiny_llama(len(tok)), tok, pack_weights=True)
    for plan in (dict(dtype="bfloat16"), dict(compute_dtype="bfloat16"), dict(sharding="fsdp")):
        with pytest.raises(ConfigError, match="packing is for float32 weights computed in float32, unshard"):
            MemoryPlan(pack_weights_for_sampling=True, **plan)


def test_the_estimate_counts_one_packed_copy_of_the_large_weights():
    # hidden 512, FFN 1024: q and o (512 x 512) and gate, up, down (512 x 1024) are packed, k and v
    # (512 x 128) are not; the head 512 x 4096 is
    shape = ModelShape(vocab=4096, hidden=512, intermediate=1024, layers=2, heads=8, kv_heads=2,
                       tie_embeddings=True)
    work = Workload(prompts_per_step=2, group_size=4, prompt_tokens=16, completion_tokens=16)
    plain = estimate_memory(shape, MemoryPlan(), work)
    with_packing = estimate_memory(shape, MemoryPlan(pack_weights_for_sampling=True), work)
    expected = 4 * (2 * (2 * 512 * 512 + 3 * 512 * 1024) + 512 * 4096)
    assert with_packing.parts["packed_weights"] == expected
    assert with_packing.phases["sampling"] - plain.phases["sampling"] == expected
    assert with_packing.phases["training"] == plain.phases["training"]
    nf4 = MemoryPlan(lora=LoRA(), quantization="nf4", pack_weights_for_sampling=True)
    qlora = estimate_memory(shape, nf4, work)
    assert qlora.parts["packed_weights"] == 4 * 512 * 4096  # the 4-bit layers are not packed
    # unmerged LoRA keeps its frozen base packed between calls: the copy counts in every phase
    for merge, kept in ((False, expected), (True, 0)):
        lora = dict(lora=LoRA(), merge_lora_for_sampling=merge)
        base = estimate_memory(shape, MemoryPlan(**lora), work)
        on = estimate_memory(shape, MemoryPlan(pack_weights_for_sampling=True, **lora), work)
        assert on.phases["sampling"] - base.phases["sampling"] == expected
        assert on.phases["training"] - base.phases["training"] == kept
        assert on.phases["optimizer"] - base.phases["optimizer"] == kept
