"""Sampling on the CPU with the large linear weights in oneDNN's packed (blocked) layout.

A decoding step multiplies a few rows (one token per live row) by every weight matrix of the model.
torch's default CPU matmul repacks the weight into its kernel's layout on every call, so a step
reads each weight, writes its packed copy and reads that again; with so few rows, this traffic is
most of a step. Inside :func:`packed_linears` each large float32 ``nn.Linear`` is run by oneDNN
with its weight reordered once, when the block starts, and every step of the call reads only the
packed copy (``benchmarks/sampler_ab.py --products`` times both products and the packing).

- The packed copies are taken when the block starts; a weight changed inside the block is not seen
  (sampling changes none). The stored weights are never written. Given a ``keep`` dict, the copies
  of the weights that train nothing (LoRA's base) stay in it between blocks and are packed again
  only when their data change.
- Only plain ``nn.Linear`` layers with a float32 weight of at least :data:`MIN_ELEMENTS` elements, on
  the CPU: smaller matrices measured slower packed; 4-bit and 8-bit layers are subclasses and are left
  alone, as are layers whose ``forward`` is already replaced on the instance (accelerate's hooks).
- A packed layer computes the same products in another order: outputs differ from ``F.linear`` by
  float32 rounding (about 1e-6 relative), so a token draw near a boundary may differ.
- With autograd recording, a layer falls back to ``F.linear``: the block is for sampling only.
- The packed matmul is the custom op ``grpo_engine::packed_linear``, so ``decoding="compiled"``
  calls it from inside the compiled step.
- Memory: one packed copy of those weights while the block runs; the frozen ones' copies stay in
  ``keep`` while it lives.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["packed_linears", "packable_layers", "plain_float32_linears", "packing_available", "packed_linear",
           "MIN_ELEMENTS"]

MIN_ELEMENTS = 1 << 17  # a 256 x 512 weight; below it, packing measured no faster on 2 CPU cores

_PACKED: dict[int, Tensor] = {}  # the weight's data pointer -> its packed copy, while a block runs


def _product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    packed = _PACKED.get(weight.data_ptr())
    if packed is None:  # outside a block (the op was called directly)
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.library.custom_op("grpo_engine::packed_linear", mutates_args=())
def packed_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)`` [..., out] through the packed copy of ``weight`` [out, in] that an
    enclosing :func:`packed_linears` block made. What a compiled graph calls; eager code calls the
    product directly, without the custom op's dispatch (tens of microseconds a call on the CPU)."""
    return _product(x, weight, bias)


@packed_linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def packing_available() -> bool:
    """Whether this torch build has oneDNN (mkldnn) on the CPU, which packing needs."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def plain_float32_linears(model: nn.Module) -> list[nn.Linear]:
    """The plain float32 ``nn.Linear`` layers of ``model`` on the CPU (not a subclass, such as a 4-bit
    layer) with no ``forward`` of their own on the instance (a packed layer, accelerate's hooks)."""
    return [m for m in model.modules()
            if type(m) is nn.Linear and type(m.weight.data) is Tensor and m.weight.device.type == "cpu"
            and m.weight.dtype == torch.float32 and "forward" not in vars(m)]


def packable_layers(model: nn.Module) -> list[nn.Linear]:
    """The layers :func:`packed_linears` packs: :func:`plain_float32_linears` with at least
    :data:`MIN_ELEMENTS` weight elements."""
    return [m for m in plain_float32_linears(model) if m.weight.numel() >= MIN_ELEMENTS]


def _forward(layer: nn.Linear):
    def forward(x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or layer.weight.requires_grad):
            return F.linear(x, layer.weight, layer.bias)
        if torch.compiler.is_compiling():
            return packed_linear(x, layer.weight, layer.bias)
        return _product(x, layer.weight, layer.bias)
    return forward


def _frozen_copy(weight: Tensor, keep: dict[int, tuple], rows: int) -> Tensor:
    """The packed copy of a weight that trains nothing, from ``keep`` while the weight still holds the
    same storage, unchanged (its version counter); packed and kept otherwise. The kept entry holds the
    storage it was packed from, so no other tensor can take its address while the entry lives."""
    storage, version = weight.untyped_storage(), weight._version
    entry = keep.get(id(weight))
    if entry is not None and entry[0].data_ptr() == storage.data_ptr() and entry[1] == version:
        return entry[2]
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    keep[id(weight)] = (storage, version, packed)
    return packed


@contextmanager
def packed_linears(model: nn.Module, rows: int, keep: dict[int, tuple] | None = None) -> Iterator[int]:
    """Runs the block with every layer of :func:`packable_layers` computing through a packed copy of
    its weight; yields how many layers were packed. ``rows``: the rows a step multiplies, the size
    oneDNN packs for (other sizes run too). ``keep``: a dict, empty at first, that keeps the packed
    copies of weights that do not require gradients (LoRA's base) from one block to the next, so they
    are packed again only when their data change; the trained weights are packed at every block.

    Raises:
        RuntimeError: this torch build has no oneDNN (:func:`packing_available`).

    Example:
        >>> layer = nn.Linear(512, 256)
        >>> x = torch.randn(4, 512)
        >>> with torch.no_grad(), packed_linears(layer, rows=4) as count:
        ...     y = layer(x)
        >>> count, torch.allclose(y, layer(x), atol=1e-5)
        (1, True)
    """
    if not packing_available():
        raise RuntimeError("packing weights for sampling needs torch's oneDNN (mkldnn) CPU backend, which "
                           "this torch build lacks; set MemoryPlan(pack_weights_for_sampling=False)")
    layers, owned = packable_layers(model), []
    if keep is not None:  # only the frozen weights packed now stay kept
        frozen = {id(layer.weight) for layer in layers if not layer.weight.requires_grad}
        for gone in set(keep) - frozen:
            del keep[gone]
    try:
        with torch.no_grad():
            for layer in layers:
                key, weight = layer.weight.data_ptr(), layer.weight
                if key not in _PACKED:  # a tied weight (or a nested block) packs once
                    kept = keep is not None and not weight.requires_grad
                    _PACKED[key] = (_frozen_copy(weight, keep, rows) if kept
                                    else torch.ops.mkldnn._reorder_linear_weight(weight, rows))
                    owned.append(key)
                layer.forward = _forward(layer)
        yield len(layers)
    finally:
        for layer in layers:
            vars(layer).pop("forward", None)
        for key in owned:
            _PACKED.pop(key, None)
