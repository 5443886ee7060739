"""Decoding with the LoRA A matrices of q/k/v and of gate/up concatenated (grpo_engine.sampling.lora_concat):
the model's output equals peft's own forward in float64, one A product per group and input, peft's state
untouched, an in-place update of the adapters followed after ``refresh()`` (and missed before it, which is
why the static runner refreshes at every call), layers it cannot group left to peft."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from grpo_engine.sampling import lora_concat
from grpo_engine.sampling.lora_concat import ConcatenatedLoRA

from .tiny import char_tokenizer, tiny_llama

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model(targets=TARGETS, dtype=torch.float64, r=4):
    """A tiny Llama (2 layers) with LoRA on ``targets``, non-zero adapters of other ranks per layer kind."""
    tok = char_tokenizer()
    base = tiny_llama(len(tok)).to(dtype)
    config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=targets,
                        rank_pattern={"v_proj": r + 2, "up_proj": r + 1})  # unequal blocks in the copy
    model = get_peft_model(base, config).eval()
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_concatenated_step_equals_peft_in_float64_and_leaves_peft_unchanged():
    model = peft_model()
    ids = torch.randint(4, 90, (3, 7))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    expected = logits(model, ids)
    concatenated = ConcatenatedLoRA(model)
    assert len(concatenated.groups) == 4  # q/k/v and gate/up of 2 layers
    assert [g.bounds for g in concatenated.groups[:2]] == [[(0, 4), (4, 8), (8, 14)], [(0, 4), (4, 9)]]
    with concatenated.installed() as groups:
        assert groups == 4
        got = logits(model, ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert not any("forward" in vars(m) for m in model.modules())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    torch.testing.assert_close(logits(model, ids), expected, rtol=0, atol=0)


def test_one_a_product_per_group_and_input(monkeypatch):
    """q, k and v read one input: the first computes the group's product, the others reuse it."""
    model = peft_model()
    concatenated = ConcatenatedLoRA(model)
    products = []
    linear = lora_concat.F.linear

    class Counting:
        @staticmethod
        def linear(x, weight, bias=None):
            if any(weight is g.cat for g in concatenated.groups):
                products.append(weight.shape[0])
            return linear(x, weight, bias)

    monkeypatch.setattr(lora_concat, "F", Counting)
    with concatenated.installed():
        logits(model, torch.randint(4, 90, (2, 5)))
    assert products == [14, 9, 14, 9]  # per layer: [A_q; A_k; A_v] (4 + 4 + 6 rows), [A_gate; A_up] (4 + 5)


def test_an_in_place_update_of_the_adapters_is_followed_after_refresh():
    model = peft_model()
    ids = torch.randint(4, 90, (2, 6))
    concatenated = ConcatenatedLoRA(model)
    with torch.no_grad():  # an optimizer step: A and B written in place
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.2)
    expected = logits(model, ids)
    with concatenated.installed():
        stale = logits(model, ids)  # B is read from peft at each forward, A from the copy
    assert (stale - expected).abs().max() > 1e-3
    concatenated.refresh()
    with concatenated.installed():
        torch.testing.assert_close(logits(model, ids), expected, rtol=0, atol=1e-12)


def test_layers_it_cannot_group_keep_peft_forward():
    """k_proj without an adapter: no q/k/v group (gate/up still grouped); adapters switched off: no group."""
    model = peft_model(targets=["q_proj", "v_proj", "gate_proj", "up_proj"])
    ids = torch.randint(4, 90, (2, 6))
    expected = logits(model, ids)
    concatenated = ConcatenatedLoRA(model)
    assert [len(g.layers) for g in concatenated.groups] == [2, 2]
    with concatenated.installed():
        torch.testing.assert_close(logits(model, ids), expected, rtol=0, atol=1e-12)
    with model.disable_adapter():
        assert ConcatenatedLoRA(model).groups == []
    assert ConcatenatedLoRA(tiny_llama(90)).groups == []  # not a peft model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_low_precision_base_with_float32_adapters_casts_as_peft_does(dtype):
    """peft keeps the adapters in float32 over a bfloat16 base and casts the input up; the result is cast
    back to the base's dtype. The concatenated product follows the same casts."""
    model = peft_model(dtype=dtype)
    assert next(p for n, p in model.named_parameters() if "lora_A" in n).dtype == torch.float32
    ids = torch.randint(4, 90, (2, 6))
    expected = logits(model, ids)
    with ConcatenatedLoRA(model).installed():
        got = logits(model, ids)
    assert got.dtype == expected.dtype
    tolerance = 1e-6 if dtype == torch.float32 else 4e-3  # equal here; another BLAS may block otherwise
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=tolerance)
