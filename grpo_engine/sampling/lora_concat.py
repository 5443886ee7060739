"""Decoding with the LoRA A matrices of sibling layers concatenated: one product for q/k/v, one for gate/up.

peft runs each adapted linear layer as ``base(x) + B(A(x)) * scaling``. The q, k and v projections of an
attention read the same input, and so do an MLP's gate and up projections, so their A products can be
one: ``low = x @ [A_q; A_k; A_v]^T`` and then ``base_q(x) + B_q(low[:, :r_q]) * s_q``, and so on, two
kernels fewer per attention and one per MLP at every decoding step.

- :class:`ConcatenatedLoRA` finds the groups in a peft model and keeps one concatenated copy of each
  group's A matrices. peft's modules and state are never changed: inside :meth:`~ConcatenatedLoRA.installed`
  each member's ``forward`` is replaced on the instance (removed on exit) by one that computes peft's
  formula with the group's product, in peft's order of casts.
- The trainer's optimizer updates A in place at each step, so the copy goes stale: :meth:`refresh` copies
  the A matrices into it again, in place (one small copy per group; the static runner does it at every
  call, so a captured graph reads the new values at the copy's fixed address). B, the base weight and
  the scaling are read from peft's modules at each forward.
- The first member a step calls computes the group's product and the later ones reuse it when called on
  the same input tensor (the projections of transformers' Llama, Mistral and Qwen families are); any
  other input gets its own product: never wrong, only not faster.
- Only plain ``peft.tuners.lora.layer.Linear`` layers with one active adapter, unmerged, enabled, no
  DoRA or other variant, no LoRA bias, dropout inactive (eval mode), the same adapter dtype; other layers
  keep peft's own forward. 4-bit (QLoRA) layers are not grouped (their casts differ).
The products are summed in the same order per column, but a wider matrix may be blocked otherwise by
BLAS: outputs equal peft's to rounding (``tests/test_lora_concat.py``, float64).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ConcatenatedLoRA", "SIBLINGS", "lora_switches"]

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # layers that read one input


def _lora_linear() -> type | None:
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return None
    return Linear


def lora_switches(model: nn.Module) -> tuple:
    """What of peft's Python state decides the path a LoRA layer's forward takes: per LoRA layer, whether
    its adapters are disabled or merged, the active adapters and their scalings (a captured step bakes
    these in; a change needs a new capture)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return ()
    return tuple((layer.disable_adapters, layer.merged, tuple(layer.active_adapters),
                  tuple(sorted(layer.scaling.items())))
                 for layer in model.modules() if isinstance(layer, LoraLayer))


def _adapter(layer: nn.Module, linear: type) -> str | None:
    """The one adapter of a plain peft LoRA Linear this module may compute, or None."""
    if type(layer) is not linear or layer.merged or layer.disable_adapters or "forward" in vars(layer):
        return None
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    dropout = layer.lora_dropout[name]
    active_dropout = dropout.training and not isinstance(dropout, nn.Identity)
    if (name in getattr(layer, "lora_variant", {}) or layer.use_dora.get(name, False)
            or layer.lora_B[name].bias is not None or active_dropout):
        return None
    return name


class _Group:
    """Sibling LoRA layers, their adapter, the bounds of each in the concatenated A, and the product of the
    step's current input (``held``: (input, product), cleared by the last member)."""

    def __init__(self, layers: list[nn.Module], adapter: str) -> None:
        self.layers, self.adapter = layers, adapter
        weights = self.weights()
        self.cat = torch.cat([w.detach() for w in weights])  # [sum r, in]
        ends = torch.tensor([w.shape[0] for w in weights]).cumsum(0).tolist()
        self.bounds = list(zip([0] + ends[:-1], ends))
        self.cast = all(getattr(layer, "cast_input_dtype_enabled", True) for layer in layers)
        self.held: tuple[Tensor, Tensor] | None = None

    def weights(self) -> list[Tensor]:
        return [layer.lora_A[self.adapter].weight for layer in self.layers]

    def product(self, x: Tensor) -> Tensor:
        """``x @ cat^T`` (x cast to the adapters' dtype, as peft does), computed once per input."""
        if self.held is not None and self.held[0] is x:
            return self.held[1]
        low = F.linear(x if not self.cast or x.dtype == self.cat.dtype else x.to(self.cat.dtype), self.cat)
        self.held = (x, low)
        return low

    def forward(self, index: int):
        layer, (lo, hi) = self.layers[index], self.bounds[index]
        last, name = index == len(self.layers) - 1, self.adapter

        def forward(x: Tensor, *args, **kwargs) -> Tensor:
            if kwargs.get("adapter_names") is not None:  # peft's mixed-batch path: its own forward
                return type(layer).forward(layer, x, *args, **kwargs)
            result = layer.base_layer(x, *args, **kwargs)
            dtype = result.dtype
            low = self.product(x)
            if last:
                self.held = None
            result = result + layer.lora_B[name](low[..., lo:hi]) * layer.scaling[name]
            return result.to(dtype)
        return forward


class ConcatenatedLoRA:
    """The groups of sibling LoRA layers of ``model`` (:data:`SIBLINGS`) and a concatenated copy of each
    group's A matrices (see the module docstring). Without peft, or without such groups, it has none and
    changes nothing.

    Example:
        >>> # lora = ConcatenatedLoRA(peft_model)
        >>> # lora.refresh()            # after the optimizer step: the new A values
        >>> # with lora.installed():
        >>> #     logits = peft_model(input_ids=ids).logits
    """

    def __init__(self, model: nn.Module) -> None:
        self.groups: list[_Group] = []
        linear = _lora_linear()
        if linear is None:
            return
        for module in model.modules():
            for names in SIBLINGS:
                layers = [getattr(module, name, None) for name in names]
                adapters = {_adapter(layer, linear) if layer is not None else None for layer in layers}
                if len(adapters) != 1 or None in adapters:
                    continue
                adapter = adapters.pop()
                weights = [layer.lora_A[adapter].weight for layer in layers]
                if len({(w.dtype, w.device, w.shape[1]) for w in weights}) == 1:
                    self.groups.append(_Group(layers, adapter))

    @torch.no_grad()
    def refresh(self) -> None:
        """Copies every member's A matrix into its group's concatenated copy, in place."""
        for group in self.groups:
            torch.cat([w.detach() for w in group.weights()], out=group.cat)

    @contextmanager
    def installed(self) -> Iterator[int]:
        """Runs the block with each grouped layer computing through its group's product; yields the number of
        groups."""
        try:
            for group in self.groups:
                for index, layer in enumerate(group.layers):
                    layer.forward = group.forward(index)
            yield len(self.groups)
        finally:
            for group in self.groups:
                group.held = None
                for layer in group.layers:
                    vars(layer).pop("forward", None)
