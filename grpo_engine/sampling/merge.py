"""Sampling with the LoRA adapters merged: one matmul per layer instead of three.

Unmerged, every adapted linear layer runs its base matmul plus the adapter's two small matmuls, a
scaling and an add, at every decoding step; on a 2-core CPU that costs SmolLM2-135M's demo about
10% of its sampling time, and on a GPU the extra kernel launches weigh more. Inside
:func:`merged_lora` each adapted base weight is replaced by a new tensor W + (alpha / r) B A and the
adapters are switched off, so the model computes the same function with plain linear layers. The
stored base weights are never written: the original tensors are put back afterwards, so nothing
drifts however many steps run. The price is one copy of the adapted weights while the block runs.

Only float32 base weights: in bfloat16 a delta smaller than half a weight's rounding step would
vanish from the merged weight, and the samples would come from another policy than the one
trained. 4-bit (QLoRA), DoRA and adapters with a bias are refused too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["merged_lora", "check_mergeable"]


def _lora_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def check_mergeable(model: nn.Module) -> None:
    """Raises ValueError naming the first layer :func:`merged_lora` cannot merge exactly."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    if not isinstance(model, PeftModel):
        raise ValueError(f"merging LoRA for sampling needs a peft LoRA model, got {type(model).__name__}; "
                         "train with MemoryPlan(lora=LoRA(...)) or set merge_lora_for_sampling=False")
    for name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        base = layer.get_base_layer()
        problem = None
        if type(base) is not nn.Linear:
            problem = f"its base layer is a {type(base).__name__} (4-bit or not a plain Linear)"
        elif base.weight.dtype != torch.float32:
            problem = (f"its base weight is {base.weight.dtype}: a LoRA delta below half a rounding step "
                       "would vanish from the merged weight")
        elif layer.merged:
            problem = "its adapter is already merged"
        elif any(layer.use_dora.get(a, False) or getattr(layer, "lora_bias", {}).get(a, False)
                 for a in layer.active_adapters):
            problem = "it uses DoRA or a LoRA bias"
        if problem:
            raise ValueError(f"cannot merge LoRA for sampling: layer {name!r}: {problem}; set "
                             "merge_lora_for_sampling=False (needs float32 base weights, no quantization)")


@contextmanager
def merged_lora(model: nn.Module) -> Iterator[None]:
    """Runs the block with every active LoRA delta merged into a copy of its base weight and the
    adapters switched off; the original weight tensors are restored on exit.

    Example:
        >>> # with merged_lora(policy):
        >>> #     batch = sampler.sample(prompts, group_size=8)
    """
    check_mergeable(model)
    swapped: list[tuple[nn.Parameter, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for layer in _lora_layers(model):
                deltas = [layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A]
                if not deltas:
                    continue
                weight = layer.get_base_layer().weight
                swapped.append((weight, weight.data))
                weight.data = weight.data + sum(deltas)  # a new tensor: the stored weight is untouched
        with model.disable_adapter():
            yield
    finally:
        for weight, data in swapped:
            weight.data = data
