"""Log-probs of chosen tokens through a plain linear lm_head, tiled over the vocabulary.

A custom autograd function: the forward pass runs the projection one vocabulary tile at a time
with an online logsumexp, keeping only [k] running statistics; the backward pass recomputes each
tile's logits and applies d log p(y) / d z = onehot(y) - softmax(z) tile by tile. Neither pass
ever holds more than ``k * vocab_tile`` logits, instead of ``k * V`` (a 151,936-token vocabulary
in 32,768-wide tiles: 4.6x less). The token entropy comes out of the same forward pass, without
gradient (a loss that needs the entropy's gradient uses the untiled path).

    z = (h W^T + b) / tau,   log p(y) = z_y - logsumexp(z),   H = logsumexp(z) - sum softmax(z) z

One tile, one chunk: when the whole vocabulary fits in one tile and the caller passes its tokens in one
chunk (``keep_logits``), the forward pass keeps its [k, V] logits for the backward pass instead of
recomputing them: one matrix product fewer, the same numbers bit for bit, and no more logits alive at
once (the backward pass turns the kept logits into the gradient in place, where it would have
recomputed them). A second backward through the same graph (``retain_graph``) recomputes them.

Only a plain ``nn.Linear`` head is tiled (tied embeddings included: the gradient lands in the
shared weight); a LoRA-wrapped or soft-capped head goes through ``logprobs.selective_logprobs``'s
checkpointed chunks instead.

Gradient into ``.grad``: inside :func:`gradients_into_grad` (the trainer's micro-batch forward and
backward), the head's weight gradient is added tile by tile into ``weight.grad`` itself, and autograd
gets none for it, as Megatron-LM's gradient-accumulation fusion does. Autograd would otherwise hold a
second full-size [V, H] buffer for it and, under tied embeddings, a third for the sum with the
embedding's gradient, before adding it to ``.grad``. The input embedding's lookup does the same (a
dense [V, H] gradient otherwise). Only a plain leaf weight takes this path (no hooks, not an FSDP2
shard); outside the context, or for ``torch.autograd.grad``, the gradient flows as usual.

Precision: every matmul runs in one compute dtype, fixed when the forward pass runs: autocast's dtype
when autocast is on for the device (mixed precision), else the head's weight dtype. The backward pass
recomputes each tile's logits in that same dtype, so its softmax agrees with the forward pass's
normaliser, and its matmuls also run in it (on a GPU, bfloat16 matmuls accumulate in float32); the
softmax, the normaliser and the gradients summed over tiles stay float32.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

__all__ = ["gradients_into_grad", "tiled_linear_logprobs", "cast_head_weight"]

_INTO_GRAD = False  # read by the forward pass (the trainer's thread), kept on the autograd context


@contextmanager
def gradients_into_grad(model: torch.nn.Module | None = None) -> Iterator[None]:
    """Inside: a tiled head's weight gradient is added into ``weight.grad`` by its backward pass, and so is
    the input embedding's of ``model`` (a plain ``nn.Embedding``, its lookup's backward adding rows into
    ``.grad`` with ``index_add_`` instead of a dense [V, H] gradient; module docstring). For a forward and
    ``backward()`` that accumulate into ``.grad`` anyway, as a training step's do; a graph built inside
    and differentiated with ``torch.autograd.grad`` would miss these two gradients."""
    global _INTO_GRAD
    embedding = _plain_embedding(model)
    before, _INTO_GRAD = _INTO_GRAD, True
    if embedding is not None:
        def lookup(ids: Tensor) -> Tensor:
            if torch.is_grad_enabled() and _writes_own_grad(embedding.weight):
                return _EmbeddingIntoGrad.apply(ids, embedding.weight, embedding.padding_idx)
            return torch.nn.Embedding.forward(embedding, ids)

        embedding.forward = lookup  # this instance only, until the context ends
    try:
        yield
    finally:
        _INTO_GRAD = before
        if embedding is not None:
            del embedding.forward


def _plain_embedding(model: torch.nn.Module | None) -> torch.nn.Embedding | None:
    """``model``'s input embedding when it is a plain ``nn.Embedding`` (no max_norm, frequency scaling,
    sparse gradient or patched forward), else None."""
    try:
        embedding = model.get_input_embeddings() if model is not None else None
    except (AttributeError, NotImplementedError):
        return None
    if (type(embedding) is not torch.nn.Embedding or embedding.max_norm is not None
            or embedding.scale_grad_by_freq or embedding.sparse or "forward" in vars(embedding)):
        return None
    return embedding


class _EmbeddingIntoGrad(torch.autograd.Function):
    """``weight[ids]``, whose backward adds each row's gradient into ``weight.grad`` (padding_idx's rows
    excepted, as ``nn.Embedding``'s) and gives autograd none."""

    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, padding_idx: int | None) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return torch.nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight, memory_format=torch.contiguous_format)
        ids, rows = ids.reshape(-1), grad_out.reshape(-1, weight.shape[1])
        if ctx.padding_idx is not None:  # padding_idx's rows add zeros (no boolean index: no host read)
            rows = torch.where((ids != ctx.padding_idx)[:, None], rows, 0.0)
        weight.grad.index_add_(0, ids, rows.to(weight.grad.dtype))
        return None, None, None


def _writes_own_grad(weight: Tensor) -> bool:
    """Whether the backward pass may add into ``weight.grad`` directly: a plain leaf (not an FSDP2 DTensor),
    no hook to run."""
    return (_INTO_GRAD and weight.is_leaf and weight.requires_grad and not hasattr(weight, "full_tensor")
            and not weight._backward_hooks and getattr(weight, "_post_accumulate_grad_hooks", None) is None)


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """Autocast's dtype when autocast is on for the device, else the weight's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def _in_tile(targets: Tensor, start: int, stop: int) -> tuple[Tensor, Tensor]:
    """(each target's column in the tile [start, stop), clamped into it; whether it lies there) [k]: a gather
    or scatter on the clamped column, kept or dropped by the flag, reads nothing back to the host (a boolean
    index would: its result's size depends on the data)."""
    local = targets - start
    return local.clamp(0, stop - start - 1), (local >= 0) & (local < stop - start)


def _tile_logits(hidden: Tensor, weight_tile: Tensor, bias: Tensor | None, start: int, stop: int,
                 temperature: float) -> Tensor:
    """[k, tile] float32 logits of one tile; ``hidden`` and ``weight_tile`` already in the compute dtype."""
    logits = hidden @ weight_tile.T
    if bias is not None:
        logits += bias[start:stop].to(hidden.dtype)
    logits = logits.float()  # a new tensor only when the compute dtype is not float32
    return logits.div_(temperature) if temperature != 1.0 else logits  # in place: no second [k, tile]


def _tile_statistics(z: Tensor, running_max: Tensor, total: Tensor, weighted: Tensor
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """The online logsumexp's running (max, sum exp(z - max), sum exp(z - max) * z) [k] after the tile's
    logits ``z`` [k, tile]; one new [k, tile] tensor, exponentiated and multiplied in place."""
    new_max = torch.maximum(running_max, z.max(dim=-1).values)
    scale = torch.exp(running_max - new_max)
    e = (z - new_max[:, None]).exp_()
    total = total * scale + e.sum(-1)
    weighted = weighted * scale + e.mul_(z).sum(-1)  # sum e * z, in e's memory
    return new_max, total, weighted


def _tile_softmax_grad(z: Tensor, log_norm: Tensor, grad_logprobs: Tensor) -> Tensor:
    """-softmax(z) * upstream [k, tile], in place in the logits' memory: one [k, tile] tensor at a time."""
    return z.sub_(log_norm[:, None]).exp_().mul_(-grad_logprobs[:, None])


def _pure_softmax_grad(z: Tensor, log_norm: Tensor, grad_logprobs: Tensor) -> Tensor:
    return torch.exp(z - log_norm[:, None]) * -grad_logprobs[:, None]  # compiled: one fused pass


_COMPILED: dict[tuple[str, str], object] = {}


def _compiled(name: str, device_type: str):
    """The tile's element-wise work through ``torch.compile`` (``compile_training``): one fused pass over
    the tile where eager runs one per operation; the gradient's pass writes a new tensor (a compiled
    function that wrote into its input would copy it back)."""
    if (name, device_type) not in _COMPILED:
        function = _tile_statistics if name == "statistics" else _pure_softmax_grad
        _COMPILED[name, device_type] = torch.compile(
            function, dynamic=True, options={"cpp_wrapper": True} if device_type == "cpu" else None)
    return _COMPILED[name, device_type]


class _TiledLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
                tile: int, compiled: bool, keep_logits: bool,
                cast_weight: Tensor | None) -> tuple[Tensor, Tensor]:
        dtype = _compute_dtype(hidden, weight)
        statistics = _compiled("statistics", hidden.device.type) if compiled else _tile_statistics
        k = hidden.shape[0]
        running_max = torch.full((k,), float("-inf"), device=hidden.device)
        total = torch.zeros(k, device=hidden.device)  # sum exp(z - max)
        weighted = torch.zeros(k, device=hidden.device)  # sum exp(z - max) * z
        target_logit = torch.zeros(k, device=hidden.device)
        h = hidden.to(dtype)  # cast once per pass; the weight once per micro-batch (``cast_weight``)
        w = cast_weight if cast_weight is not None else weight.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):  # the dtype is explicit
            for start in range(0, weight.shape[0], tile):
                stop = min(start + tile, weight.shape[0])
                z = _tile_logits(h, w[start:stop], bias, start, stop, temperature)
                local, inside = _in_tile(targets, start, stop)
                target_logit = torch.where(inside, z.gather(1, local[:, None]).squeeze(1), target_logit)
                running_max, total, weighted = statistics(z, running_max, total, weighted)
        log_norm = running_max + torch.log(total)
        # one tile: its logits z, untouched by the statistics, are the ones the backward pass would recompute
        keep = keep_logits and weight.shape[0] <= tile and any(ctx.needs_input_grad[:3])
        ctx.logits = z if keep else None
        ctx.logits_version = z._version if keep else None
        ctx.save_for_backward(hidden, weight, bias, targets, log_norm, cast_weight)
        ctx.temperature, ctx.tile, ctx.dtype, ctx.compiled = temperature, tile, dtype, compiled
        ctx.into_grad = _writes_own_grad(weight)
        entropy = log_norm - weighted / total
        ctx.mark_non_differentiable(entropy)
        return target_logit - log_norm, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor, _grad_entropy: Tensor | None):
        hidden, weight, bias, targets, log_norm, cast_weight = ctx.saved_tensors
        dtype = ctx.dtype
        one_tile = weight.shape[0] <= ctx.tile  # the sums below are then single products: no zeroed buffers
        grad_hidden = (None if one_tile else
                       torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device))
        grad_weight = None
        if ctx.needs_input_grad[1] and ctx.into_grad:  # added into .grad here; autograd gets None
            if weight.grad is None and not one_tile:
                weight.grad = torch.zeros_like(weight, memory_format=torch.contiguous_format)
            grad_weight = weight.grad
        elif ctx.needs_input_grad[1] and not one_tile:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) \
            if bias is not None and ctx.needs_input_grad[2] else None
        softmax_grad = _compiled("softmax_grad", hidden.device.type) if ctx.compiled else _tile_softmax_grad
        h = hidden.to(dtype)
        cast = cast_weight if cast_weight is not None else weight.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, weight.shape[0], ctx.tile):
                stop = min(start + ctx.tile, weight.shape[0])
                w = cast[start:stop]
                z, ctx.logits = ctx.logits, None  # the kept logits serve one backward pass
                if z is None or z._version != ctx.logits_version:
                    z = _tile_logits(h, w, bias, start, stop, ctx.temperature)
                g = softmax_grad(z, log_norm, grad_logprobs)
                local, inside = _in_tile(targets, start, stop)  # + upstream at each row's target in the tile
                g.scatter_add_(1, local[:, None], torch.where(inside, grad_logprobs, 0.0)[:, None])
                if ctx.temperature != 1.0:
                    g.div_(ctx.temperature)  # [k, tile], d loss / d (h W^T + b), float32
                if grad_bias is not None:
                    grad_bias[start:stop] += g.sum(0)
                g = g.to(dtype)
                if not one_tile:
                    grad_hidden += g @ w
                    if grad_weight is not None:
                        grad_weight[start:stop] += g.T @ h
                    continue
                # one tile: the sums' values (0 + x is x) without zeroing a buffer for them
                grad_hidden = (g @ w).float()
                if grad_weight is not None:  # .grad held a gradient already
                    grad_weight += g.T @ h
                elif ctx.needs_input_grad[1] and ctx.into_grad:
                    weight.grad = (g.T @ h).to(weight.dtype)
                elif ctx.needs_input_grad[1]:
                    grad_weight = (g.T @ h).float()
        return (grad_hidden.to(hidden.dtype),
                grad_weight.to(weight.dtype) if grad_weight is not None and not ctx.into_grad else None,
                grad_bias.to(bias.dtype) if grad_bias is not None else None, *[None] * 6)


def tiled_linear_logprobs(hidden: Tensor, head: torch.nn.Linear, targets: Tensor, *, temperature: float = 1.0,
                          vocab_tile: int = 32768, compiled: bool = False, keep_logits: bool = False,
                          cast_weight: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(logprobs [k], entropy [k])`` of ``targets`` under ``head(hidden) / temperature``.

    Args:
        hidden: [k, H] hidden states.
        head: a plain linear output projection (weight [V, H], optional bias [V]).
        targets: [k] token ids.
        temperature: logits are divided by it.
        vocab_tile: vocabulary entries per tile.
        compiled: each tile's element-wise work through ``torch.compile`` (fused; one more [k, tile]
            tensor alive in the backward pass).
        keep_logits: when the vocabulary fits in one tile, keep the [k, V] logits from the forward
            pass to the backward pass instead of recomputing them (module docstring). For a caller
            whose backward pass follows before any other logits are made: it holds them meanwhile.
        cast_weight: the head's weight already in the compute dtype, detached (:func:`cast_head_weight`),
            read by the forward and backward passes of every chunk that gets it instead of casting the
            weight again; gradients still go to ``head.weight``.

    Returns:
        Float32 log-probs (differentiable w.r.t. ``hidden`` and the head) and the token entropy
        (no gradient).

    Example:
        >>> head = torch.nn.Linear(4, 10, bias=False)
        >>> lp, ent = tiled_linear_logprobs(torch.randn(3, 4), head, torch.tensor([1, 2, 9]), vocab_tile=4)
        >>> lp.shape, bool((ent > 0).all())
        (torch.Size([3]), True)
    """
    if vocab_tile < 1:
        raise ValueError(f"vocab_tile={vocab_tile} must be >= 1; use e.g. 32768")
    return _TiledLinearLogprobs.apply(hidden, head.weight, head.bias, targets, temperature, vocab_tile,
                                      compiled, keep_logits, cast_weight)


def cast_head_weight(hidden: Tensor, head: torch.nn.Linear) -> Tensor | None:
    """``head``'s weight in the compute dtype of a pass over ``hidden`` (autocast's, else the weight's),
    detached, for every chunk of one micro-batch (``tiled_linear_logprobs(cast_weight=...)``); None when the
    weight is already in it (nothing to cast). One [V, H] copy in the compute dtype while the micro-batch
    runs, where a cast per chunk and per pass would make one each time."""
    dtype = _compute_dtype(hidden, head.weight)
    return None if head.weight.dtype == dtype else head.weight.detach().to(dtype)
