"""Log-probs of chosen tokens through a plain linear lm_head, tiled over the vocabulary.

A custom autograd function: the forward pass runs the projection one vocabulary tile at a time
with an online logsumexp, keeping only [k] running statistics; the backward pass recomputes each
tile's logits and applies d log p(y) / d z = onehot(y) - softmax(z) tile by tile. Neither pass
ever holds more than ``k * vocab_tile`` logits, instead of ``k * V`` (a 151,936-token vocabulary
in 32,768-wide tiles: 4.6x less). The token entropy comes out of the same forward pass, without
gradient (a loss that needs the entropy's gradient uses the untiled path).

    z = (h W^T + b) / tau,   log p(y) = z_y - logsumexp(z),   H = logsumexp(z) - sum softmax(z) z

Only a plain ``nn.Linear`` head is tiled (tied embeddings included: the gradient lands in the
shared weight); a LoRA-wrapped or soft-capped head goes through ``logprobs.selective_logprobs``'s
checkpointed chunks instead.

Precision: every matmul runs in one compute dtype, fixed when the forward pass runs: autocast's dtype
when autocast is on for the device (mixed precision), else the head's weight dtype. The backward pass
recomputes each tile's logits in that same dtype, so its softmax agrees with the forward pass's
normaliser, and its matmuls also run in it (on a GPU, bfloat16 matmuls accumulate in float32); the
softmax, the normaliser and the gradients summed over tiles stay float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["tiled_linear_logprobs"]


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """Autocast's dtype when autocast is on for the device, else the weight's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def _tile_logits(hidden: Tensor, weight_tile: Tensor, bias: Tensor | None, start: int, stop: int,
                 temperature: float) -> Tensor:
    """[k, tile] float32 logits of one tile; ``hidden`` and ``weight_tile`` already in the compute dtype."""
    logits = hidden @ weight_tile.T
    if bias is not None:
        logits = logits + bias[start:stop].to(hidden.dtype)
    return logits.float() / temperature


class _TiledLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
                tile: int) -> tuple[Tensor, Tensor]:
        dtype = _compute_dtype(hidden, weight)
        k = hidden.shape[0]
        running_max = torch.full((k,), float("-inf"), device=hidden.device)
        total = torch.zeros(k, device=hidden.device)  # sum exp(z - max)
        weighted = torch.zeros(k, device=hidden.device)  # sum exp(z - max) * z
        target_logit = torch.zeros(k, device=hidden.device)
        h = hidden.to(dtype)  # cast once per pass, each weight tile once per tile
        with torch.autocast(hidden.device.type, enabled=False):  # the dtype is explicit
            for start in range(0, weight.shape[0], tile):
                stop = min(start + tile, weight.shape[0])
                z = _tile_logits(h, weight[start:stop].to(dtype), bias, start, stop, temperature)
                new_max = torch.maximum(running_max, z.max(dim=-1).values)
                scale = torch.exp(running_max - new_max)
                e = torch.exp(z - new_max[:, None])
                total = total * scale + e.sum(-1)
                weighted = weighted * scale + (e * z).sum(-1)
                running_max = new_max
                inside = (targets >= start) & (targets < stop)
                target_logit[inside] = z[inside, targets[inside] - start]
        log_norm = running_max + torch.log(total)
        ctx.save_for_backward(hidden, weight, bias, targets, log_norm)
        ctx.temperature, ctx.tile, ctx.dtype = temperature, tile, dtype
        entropy = log_norm - weighted / total
        ctx.mark_non_differentiable(entropy)
        return target_logit - log_norm, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor, _grad_entropy: Tensor | None):
        hidden, weight, bias, targets, log_norm = ctx.saved_tensors
        dtype = ctx.dtype
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) \
            if bias is not None and ctx.needs_input_grad[2] else None
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        h = hidden.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, weight.shape[0], ctx.tile):
                stop = min(start + ctx.tile, weight.shape[0])
                w = weight[start:stop].to(dtype)
                z = _tile_logits(h, w, bias, start, stop, ctx.temperature)
                g = -torch.exp(z - log_norm[:, None]) * grad_logprobs[:, None]  # -softmax * upstream
                inside = (targets >= start) & (targets < stop)
                g[rows[inside], targets[inside] - start] += grad_logprobs[inside]
                g = g / ctx.temperature  # [k, tile], d loss / d (h W^T + b), float32
                if grad_bias is not None:
                    grad_bias[start:stop] += g.sum(0)
                g = g.to(dtype)
                grad_hidden += g @ w
                if grad_weight is not None:
                    grad_weight[start:stop] += g.T @ h
        return (grad_hidden.to(hidden.dtype),
                grad_weight.to(weight.dtype) if grad_weight is not None else None,
                grad_bias.to(bias.dtype) if grad_bias is not None else None, None, None, None)


def tiled_linear_logprobs(hidden: Tensor, head: torch.nn.Linear, targets: Tensor, *, temperature: float = 1.0,
                          vocab_tile: int = 32768) -> tuple[Tensor, Tensor]:
    """``(logprobs [k], entropy [k])`` of ``targets`` under ``head(hidden) / temperature``.

    Args:
        hidden: [k, H] hidden states.
        head: a plain linear output projection (weight [V, H], optional bias [V]).
        targets: [k] token ids.
        temperature: logits are divided by it.
        vocab_tile: vocabulary entries per tile.

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
    return _TiledLinearLogprobs.apply(hidden, head.weight, head.bias, targets, temperature, vocab_tile)
