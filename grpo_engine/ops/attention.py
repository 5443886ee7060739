"""What every decoder pass of ours (training, sampling, the compiled layers) takes from a transformers
decoder: position ids from a padding mask, the cache keyword, 4D attention masks, an attention function
swapped in for one block, and which models the fixed-shape paths can run. Pure helpers, below the
log-prob pass, the samplers and the compiled layers, which all import them from here."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

__all__ = ["position_ids_from_mask", "kv_cache", "is_decoder_lm", "supports_static",
           "attention_implementation", "prompt_attention", "completion_attention", "attention_mask",
           "decoder_masks", "FAMILIES"]

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # plain rotary attention, no logit soft-capping or sinks


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """[n, T] positions counting only attended tokens (left padding gets position 0).

    Example:
        >>> position_ids_from_mask(torch.tensor([[0, 1, 1], [1, 1, 1]])).tolist()
        [[0, 0, 1], [0, 1, 2]]
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def kv_cache(out) -> tuple[str, object]:
    """(keyword, cache) of a transformers output: ``cache`` since transformers 5.2x, else
    ``past_key_values``; pass it back under the same keyword."""
    name = "cache" if getattr(out, "cache", None) is not None else "past_key_values"
    return name, getattr(out, name, None)


def is_decoder_lm(model: nn.Module) -> bool:
    """Whether our decoding loops can run the model: a transformers causal LM (else only its
    ``generate()`` is used)."""
    return getattr(model, "config", None) is not None and hasattr(model, "get_decoder")


def supports_static(model: nn.Module) -> str | None:
    """None when the fixed-shape paths (the static KV cache, the compiled training layers with a shared
    prompt) can run ``model``, else why not (one phrase)."""
    if not is_decoder_lm(model):
        return "not a transformers causal LM"
    config = model.config
    if getattr(config, "model_type", None) not in FAMILIES:
        return (f"model type {getattr(config, 'model_type', None)!r} "
                f"(the static path knows {', '.join(FAMILIES)})")
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation not in ("sdpa", "eager"):
        return f"attention implementation {implementation!r} (needs 'sdpa' or 'eager': a 4D mask)"
    layer_types = getattr(config, "layer_types", None) or ()
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        return "sliding-window or non-attention layers"
    return None


@contextlib.contextmanager
def attention_implementation(config, name: str, function) -> Iterator[str | None]:
    """Runs the block with the model's attention layers calling ``function``, registered with transformers
    as ``name``; yields the implementation it replaces, put back at the end."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, function)
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield before
    finally:
        config._attn_implementation = before


def prompt_attention(mask: Tensor) -> Tensor:
    """[b, 1, P, P] which keys each query of left-padded prompts ``mask`` [b, P] attends to: the earlier
    real tokens, and itself (a padding query then stays finite)."""
    width, device = mask.shape[1], mask.device
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    return (causal & mask[:, None, None, :].bool()) | torch.eye(width, dtype=torch.bool, device=device)


def attention_mask(allowed: Tensor, eager: bool, dtype: torch.dtype) -> Tensor:
    """The boolean 4D mask ``allowed`` (True: attend) in the form the model's attention takes: boolean for
    sdpa, additive (0 / the dtype's min) for eager attention."""
    if not eager:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed,
                                                                                       torch.finfo(dtype).min)


def completion_attention(prompt_mask: Tensor, fed_mask: Tensor) -> Tensor:
    """[n, 1, L, P + L] which keys each of the L completion tokens ``fed_mask`` [n, L] attends to after the
    left-padded prompts ``prompt_mask`` [n, P]: the real prompt tokens, and the real completion tokens up
    to itself."""
    n, width = prompt_mask.shape
    length, device = fed_mask.shape[1], fed_mask.device
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return torch.cat([prompt_mask[:, None, None, :].bool().expand(n, 1, length, width),
                      causal & fed_mask[:, None, None, :].bool()], dim=-1)


def decoder_masks(model: nn.Module, mask: Tensor, allowed: Tensor, *, dense: bool = False,
                  offset: int = 0) -> dict[str, Tensor | None]:
    """The ``attention_mask`` and ``position_ids`` to pass ``model``'s decoder for tokens whose padding mask
    is ``mask`` [n, T] (``offset``: the first ``offset`` columns are in the KV cache already), without
    transformers reading the padding back to the host (on a GPU, a wait):

    - ``dense`` (the host knows no token is padding; for a pass that uses a KV cache, without which
      transformers would read the positions back to look for packed sequences): neither, so transformers
      takes the causal path and counts positions from the cache, as it does for a mask of ones it has read;
    - a model whose attention takes a 4D mask (sdpa or eager attention in a family :func:`supports_static`
      knows): ``allowed`` [n, 1, T - offset, T] (True: attend) in its form, so transformers builds none;
    - any other: the 2D mask, for transformers to build its own.

    Example:
        >>> decoder_masks(None, torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 1, 2, 2, dtype=torch.bool),
        ...               dense=True)
        {'attention_mask': None, 'position_ids': None}
    """
    if dense:
        return {"attention_mask": None, "position_ids": None}
    positions = position_ids_from_mask(mask)[:, offset:]
    if supports_static(model) is not None:
        return {"attention_mask": mask.long(), "position_ids": positions}
    eager = (getattr(model.config, "_attn_implementation", None) or "eager") == "eager"
    dtype = model.get_input_embeddings().weight.dtype
    return {"attention_mask": attention_mask(allowed, eager, dtype), "position_ids": positions}
