"""The compiled decoding step on the CPU with its linear products compiled into the step's own loops.

A decoding step multiplies a few rows (one token per live row) by every weight matrix of the model. On
the CPU, ``torch.compile`` hands each of these products to the BLAS library as a matrix product, and
for so few rows the library's kernel is slow (``benchmarks/sampler_ab.py --products`` times one
step's products both ways). Inside :func:`compiled_products`, each float32 ``nn.Linear`` computes
``y[m, n] = sum_k w[n, k] x[m, k]`` as a multiply and a sum (:func:`product_as_reduction`), which
inductor compiles into the step's C++ loops: one pass over each weight row, vectorised along it, for
all rows of ``x`` at once (up to 32 rows, an accumulator per row), and fused with the products and
element-wise work around it (the gate and up projections read their input in one loop).

- Only while a graph is being compiled with autograd off: the eager prefill and any eager step run
  ``F.linear`` as before, so the setting changes the compiled step alone.
- It pays where the weights stay in the CPU's caches: a small model, few rows. On a Qwen2.5-0.5B-shaped
  model it gained nothing with 8 rows, and on a 5M-parameter model it was slower with 32 rows
  (docs/memory.md).
- The products are summed in another order: outputs differ from ``F.linear`` by float32 rounding
  (about 1e-6 relative), so a token draw near a boundary may differ.
- Plain ``nn.Linear`` layers with a float32 weight on the CPU whose ``forward`` is not already replaced
  on the instance (packed layers, accelerate's hooks); 4-bit and 8-bit layers are subclasses and are left
  alone. LoRA's layers are plain ``nn.Linear`` inside peft's wrapper, so they are covered too.
- No memory: inductor never builds the [out, rows, in] product, it sums as it multiplies.
- The input's layout is pinned with inductor's ``inductor_force_stride_order``: without it inductor may
  lay the rows innermost and recompute the norm before the product for every weight row, slower than
  BLAS.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpo_engine.sampling.packed import plain_float32_linears

__all__ = ["compiled_products", "product_as_reduction", "compiled_products_available", "reducible_layers",
           "UNROLLED_ROWS"]


def compiled_products_available() -> bool:
    """Whether this torch has the inductor primitive that pins the input's layout."""
    try:
        import torch._inductor.inductor_prims  # noqa: F401  (registers prims.inductor_force_stride_order)
    except ImportError:
        return False
    return hasattr(torch.ops.prims, "inductor_force_stride_order")


def _require_primitive() -> None:
    if not compiled_products_available():
        raise RuntimeError("compiled products need torch's inductor primitive inductor_force_stride_order, "
                           f"which torch {torch.__version__} lacks; set "
                           "MemoryPlan(compiled_products_for_sampling=False)")


UNROLLED_ROWS = 32  # up to this many rows of x, one sum per row (see product_as_reduction)


def product_as_reduction(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` [..., in] and ``weight`` [out, in], written as a multiply
    and a sum over ``in`` that inductor compiles into one loop over each weight row. It is meant for
    compiled code: run eagerly it builds [out, in] products.

    Up to :data:`UNROLLED_ROWS` rows, each row of ``x`` is its own sum, and inductor fuses the sums into
    one loop that loads each vector of a weight row once and adds it, times each row, into that row's
    own accumulator: independent additions the CPU overlaps, where one sum over all rows chains every
    addition of a dot product to the one before (llama-small, 8 rows: a sampling call 132 ms instead
    of 155). Above that, one sum over all rows (the unrolled graph would grow with the rows).

    Raises:
        RuntimeError: this torch lacks the primitive (:func:`compiled_products_available`).
    """
    if not hasattr(torch.ops.prims, "inductor_force_stride_order"):
        _require_primitive()
    rows = x.reshape(-1, x.shape[-1])
    rows = torch.ops.prims.inductor_force_stride_order(rows, (rows.shape[-1], 1))  # rows outermost
    if rows.shape[0] <= UNROLLED_ROWS:
        out = torch.stack([(weight * rows[i]).sum(-1) for i in range(rows.shape[0])])
    else:
        out = (weight[:, None, :] * rows[None]).sum(-1).t()
    out = out.reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def reducible_layers(model: nn.Module) -> list[nn.Linear]:
    """The layers :func:`compiled_products` changes: every
    :func:`~grpo_engine.sampling.packed.plain_float32_linears`, whatever its size."""
    return plain_float32_linears(model)


def _forward(layer: nn.Linear):
    def forward(x: Tensor) -> Tensor:
        if not torch.compiler.is_compiling() or (
                torch.is_grad_enabled() and (x.requires_grad or layer.weight.requires_grad)):
            return F.linear(x, layer.weight, layer.bias)
        return product_as_reduction(x, layer.weight, layer.bias)
    return forward


@contextmanager
def compiled_products(model: nn.Module) -> Iterator[int]:
    """Runs the block with every layer of :func:`reducible_layers` computing, in code being compiled
    without autograd, through :func:`product_as_reduction`; yields how many layers it changed.

    Raises:
        RuntimeError: this torch lacks the primitive (:func:`compiled_products_available`).

    Example:
        >>> layer = nn.Linear(64, 32)
        >>> x = torch.randn(4, 64)
        >>> with torch.no_grad(), compiled_products(layer) as count:
        ...     y = layer(x)  # eager: F.linear
        >>> count, torch.equal(y, layer(x))
        (1, True)
    """
    _require_primitive()
    layers = reducible_layers(model)
    try:
        for layer in layers:
            layer.forward = _forward(layer)
        yield len(layers)
    finally:
        for layer in layers:
            vars(layer).pop("forward", None)
