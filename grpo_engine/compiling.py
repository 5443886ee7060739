"""``MemoryPlan(compile_training=True)``: the training pass through compiled decoder layers.

On a small model a decoder layer spends as much time in element-wise work and per-operation overhead
as in matrix products: RMSNorm's upcast, square, mean, rsqrt and two multiplies, the rotary embedding,
the MLP's SiLU and gate product and the residual adds are each a kernel, in the forward and again in
the backward. :func:`compiled_layers` runs every decoder layer through ``torch.compile`` for the
duration of the trainer's micro-batch forward (the backward runs the compiled backward), so each
layer's element-wise work becomes a few fused kernels. Outside it the layers are the eager ones:
sampling, evaluation and every no-gradient pass are unchanged.

- No KV cache object enters a compiled layer: transformers' cache is Python state that differs per
  layer and per pass, and a graph specialised on it recompiles past torch's limit. A training pass
  that shares the prompt across its group (``share_prompt``) therefore runs the prompt once without a
  cache, records each layer's keys and values through :func:`shared_prompt_attention` (an attention
  function registered with transformers), and hands each layer its own prompt keys and values in the
  completion pass, where that attention function attends over [prompt, completion]. This needs a
  Llama / Mistral / Qwen2 / Qwen3-family decoder in ``sdpa`` or ``eager`` attention
  (``sampling.static.supports_static``); any other model compiles its layers and runs the whole prompt
  with every completion.
- Shapes are dynamic from the first call (``dynamic=True``): a step's widths vary. The layers share one
  compiled function (the layer is an argument), so a model compiles a few graphs (one per kind of
  pass, one more when a width first differs from a size it was specialised to, such as 1), not one per
  layer or per step.
- On the CPU, inductor's C++ wrapper (``cpp_wrapper``) calls the kernels from C++ rather than Python,
  which matters for a small model's many small kernels (not under gradient checkpointing, whose
  graphs it cannot call yet). Compiling needs a C++ compiler there.
- The numbers agree with the eager pass to rounding, not bit for bit: fused kernels sum in another
  order. ``tests/test_compiling.py`` compares log-probs and gradients with the eager pass's in a float64
  model, to float32's precision (transformers' RMSNorm computes in float32 whatever the weights).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import Tensor, nn

from grpo_engine.ops.attention import (
    attention_implementation,
    attention_mask,
    completion_attention,
    decoder_masks,
    position_ids_from_mask,
    prompt_attention,
    supports_static,
)

__all__ = ["compiled_layers", "compiled_hidden", "shared_prompt_attention", "SHARED_ATTENTION"]

SHARED_ATTENTION = "grpo_engine_shared_prompt"  # the name shared_prompt_attention is registered under
_COMPILED: dict[tuple[type, bool], object] = {}  # (layer class, C++ wrapper) -> its compiled forward


def shared_prompt_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                            attention_mask: Tensor | None, *, attention_base: str,
                            prompt_record: list | None = None, prompt_kv: tuple[Tensor, Tensor] | None = None,
                            **kwargs) -> tuple[Tensor, None]:
    """The attention of a training pass that shares the prompt: transformers' ``attention_base``
    attention (``"sdpa"`` or ``"eager"``) with, in the prompt pass, this layer's keys and values
    appended to ``prompt_record``, and in the completion pass, ``prompt_kv`` ([n, kv, P, d] each: the
    prompt's, one row per completion) put before the completion's own. ``attention_mask``: the 4D mask
    over the keys attended to, in ``attention_base``'s form."""
    if prompt_record is not None:
        prompt_record.append((key, value))
    if prompt_kv is not None:
        key, value = torch.cat([prompt_kv[0], key], dim=2), torch.cat([prompt_kv[1], value], dim=2)
    return _attention_function(module, attention_base)(module, query, key, value, attention_mask, **kwargs)


def _attention_function(module: nn.Module, name: str):
    """transformers' attention function ``name``; ``"eager"`` is the model's own module-level one."""
    if name == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def compiled_hidden(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, fed_ids: Tensor,
                    fed_mask: Tensor, *, distinct: tuple[Tensor, Tensor] | None) -> Tensor:
    """[n, C, H] hidden states predicting each completion token, given its first C - 1 tokens
    ``fed_ids`` / ``fed_mask``, through compiled layers: with ``distinct`` (``logprobs.TokenIndex``: fewer
    distinct prompts than rows) and a model :func:`grpo_engine.ops.attention.supports_static` accepts, the
    prompt once per distinct prompt (module docstring); else the whole [prompt, fed tokens] of each row."""
    decoder = model.get_decoder()
    n, width = prompt_ids.shape
    if distinct is None or supports_static(model) is not None:
        mask = torch.cat([prompt_mask, fed_mask], dim=1)  # [n, P + C - 1]
        with compiled_layers(model):
            out = decoder(input_ids=torch.cat([prompt_ids, fed_ids], dim=1),
                          **decoder_masks(model, mask, prompt_attention(mask)), use_cache=False)
        return out.last_hidden_state[:, width - 1:]  # position t-1 predicts completion token t
    first, inverse = distinct
    dtype = model.get_input_embeddings().weight.dtype  # (a 4-bit base: not its)
    head_mask = prompt_mask[first]  # [u, P]
    length = fed_ids.shape[1]
    allowed = completion_attention(prompt_mask, fed_mask)  # [n, 1, C - 1, P + C - 1]
    record: list[tuple[Tensor, Tensor]] = []
    with attention_implementation(decoder.config, SHARED_ATTENTION, shared_prompt_attention) as before:
        base = before or "eager"
        eager = base == "eager"
        head = decoder(input_ids=prompt_ids[first],
                       attention_mask=attention_mask(prompt_attention(head_mask), eager, dtype),
                       position_ids=position_ids_from_mask(head_mask.long()), use_cache=False,
                       attention_base=base, prompt_record=record)  # eager: it appends to `record`
        last_prompt = head.last_hidden_state[:, -1][inverse]  # [n, H]: predicts completion token 0
        if length == 0:  # one-token completions
            return last_prompt[:, None]
        prompt_kv = [(key[inverse], value[inverse]) for key, value in record]  # [u, ...] -> [n, ...]
        positions = position_ids_from_mask(torch.cat([prompt_mask, fed_mask], dim=1).long())
        with compiled_layers(model, prompt_kv):
            rest = decoder(input_ids=fed_ids, attention_mask=attention_mask(allowed, eager, dtype),
                           position_ids=positions[:, width:], use_cache=False, attention_base=base)
    return torch.cat([last_prompt[:, None], rest.last_hidden_state], dim=1)


def _compiled(layer: nn.Module):
    """``layer.forward`` through the compiled ``forward`` of its class (the layer an argument: every
    layer shares one compiled function, and no compiled function holds a layer)."""
    # the C++ wrapper cannot yet call the RNG-state operation a checkpointed layer's graph holds
    checkpointed = getattr(layer, "gradient_checkpointing", False)
    cpp = next(layer.parameters()).device.type == "cpu" and not checkpointed
    key = (type(layer), cpp)
    if key not in _COMPILED:
        # emulate_precision_casts: round where the eager code casts down (transformers' RMSNorm computes in
        # float32 whatever the weights), as eager does; inductor would otherwise keep the wider type
        options = {"emulate_precision_casts": True, **({"cpp_wrapper": True} if cpp else {})}
        _COMPILED[key] = torch.compile(type(layer).forward, dynamic=True, options=options)
    return partial(_COMPILED[key], layer)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder's layers.

    Raises:
        ValueError: the decoder has no ``layers`` ModuleList (not a transformers decoder-only LM).
    """
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"compile_training=True needs a decoder with a `layers` ModuleList (Llama, Qwen2, "
                         f"Mistral and most transformers decoders); {type(decoder).__name__} has none; set "
                         "MemoryPlan(compile_training=False)")
    return layers


@contextmanager
def compiled_layers(model: nn.Module, prompt_kv: list[tuple[Tensor, Tensor]] | None = None) -> Iterator[None]:
    """Inside: each decoder layer of ``model`` runs compiled (compiled at the first call, then reused);
    with ``prompt_kv`` (one (keys, values) per layer), layer i is also given ``prompt_kv[i]`` (for
    :func:`shared_prompt_attention`).

    Raises:
        ValueError: a layer's ``forward`` is already replaced on the instance (accelerate's device-map
            hooks do that), so it cannot be swapped.
        RuntimeError: compiling failed (no C++ compiler on the CPU, an operation inductor cannot
            compile), with the fix.
    """
    layers = list(decoder_layers(model))
    patched = [index for index, layer in enumerate(layers) if "forward" in vars(layer)]
    if patched:
        raise ValueError(f"compile_training=True: decoder layers {patched[:4]} have a forward replaced on "
                         "the instance (accelerate's device_map hooks do that); load the model without "
                         "device_map, or set MemoryPlan(compile_training=False)")
    for index, layer in enumerate(layers):
        compiled = _compiled(layer)
        layer.forward = (compiled if prompt_kv is None  # this instance only, until the context ends
                         else partial(compiled, prompt_kv=prompt_kv[index]))
    try:
        yield
    except torch._dynamo.exc.BackendCompilerFailed as error:
        raise RuntimeError(f"compile_training=True: torch.compile could not compile the decoder layers "
                           f"({str(error).splitlines()[0][:300]}); on the CPU it needs a C++ compiler (g++ "
                           "or clang); set MemoryPlan(compile_training=False) to train without it") from error
    finally:
        for layer in layers:
            del layer.forward
