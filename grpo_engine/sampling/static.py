"""The fixed-shape decoding path: a static KV cache, one-token steps of fixed shape, on a GPU a CUDA graph.

- :class:`StaticKVCache`: B*G rows x (P + C) slots per layer, preallocated and written in place at a slot
  index held in a device tensor; keys are masked by a 4D attention mask kept in a buffer, so no shape
  depends on the step. The prompt is prefilled once per distinct prompt and the cache repeated G times.
- :meth:`StaticDecoder.step` reads and writes only preallocated buffers: it feeds the previous token,
  draws the next with ``TokenDraw``, writes it and its log-prob at column t, and keeps the EOS flags on
  the device (the host reads them every ``check_every`` tokens); a finished row keeps computing, with
  padding for its tokens and 0 for its log-probs.
- :func:`grouped_attention`: the query heads that share a KV head are one matrix product against that
  head's keys, so the cache is read once per step and never expanded to every query head.
- ``mode``: ``"eager"`` (Python; the same tokens as the dynamic loop), ``"compiled"`` (``torch.compile``,
  uniforms drawn outside; the first step through dynamo's guards, the later ones call its compiled graph
  directly), ``"cuda_graph"`` (uniforms + step captured once per call, replayed per token).
Needs a Llama / Mistral / Qwen2 / Qwen3-family decoder with full attention in ``sdpa`` or ``eager`` mode
(:func:`supports_static`); the sampler falls back to the dynamic loop otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from grpo_engine.ops.attention import (
    attention_implementation,
    attention_mask,
    position_ids_from_mask,
    prompt_attention,
    supports_static,
)
from grpo_engine.sampling.decode import BAD_DISTRIBUTION, PhaseClock, TokenDraw, draw_uniforms

__all__ = ["StaticKVCache", "StaticDecoder", "decode_static", "supports_static", "static_cache_bytes",
           "grouped_attention", "attention_implementation", "attention_mask", "prompt_attention"]

Mode = Literal["eager", "compiled", "cuda_graph"]
ATTENTION = "grpo_engine_grouped"  # the name grouped_attention is registered under in transformers


def grouped_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor, *,
                      scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """Attention of ``query`` [n, h, q, d] over ``key`` / ``value`` [n, kv, W, d] (h a multiple of
    kv) under a boolean ``attention_mask`` [n, 1, q, W] (True = attend), with the h / kv query heads
    of a KV head stacked into one product, so the keys are read once and never repeated per head.
    The softmax runs in float32. Returns [n, q, h, d] (transformers' attention-interface layout).
    """
    n, h, q, d = query.shape
    kv, width = key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    grouped = query.reshape(n, kv, (h // kv) * q, d)  # head i uses KV head i // (h / kv)
    scores = torch.matmul(grouped, key.transpose(-1, -2)).view(n, kv, h // kv, q, width).float() * scale
    scores = scores.masked_fill(~attention_mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype).view(n, kv, (h // kv) * q, width)
    out = torch.matmul(probs, value)  # [n, kv, h/kv * q, d]
    return out.view(n, h, q, d).transpose(1, 2), None


def _grouped_attention(model: nn.Module):
    """Runs the block with the model's attention layers calling :func:`grouped_attention`."""
    return attention_implementation(model.config, ATTENTION, grouped_attention)


def static_cache_bytes(model_config, rows: int, width: int, dtype: torch.dtype) -> int:
    """Bytes of the static KV cache: ``rows`` x ``width`` slots x layers x (keys + values)."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    element = torch.empty((), dtype=dtype).element_size()
    return rows * width * model_config.num_hidden_layers * 2 * kv_heads * head_dim * element


class StaticKVCache:
    """Keys and values of every layer, each [rows, kv_heads, width, head_dim], allocated on the
    first write and then written in place at ``slot`` ([1] long, on the device).

    The model calls ``update(keys, values, layer_idx, ...)`` from its attention layers (the one
    method of transformers' cache interface this path relies on) and attends over what it returns:
    every slot, with the 4D mask deciding which count.
    """

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.rows, self.width = rows, width
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx == len(self.keys):  # first write of this layer: allocate it
            shape = (self.rows, key_states.shape[1], self.width, key_states.shape[3])
            self.keys.append(key_states.new_zeros(shape))
            self.values.append(value_states.new_zeros(shape[:3] + (value_states.shape[3],)))
        positions = self.slot if key_states.shape[2] == 1 else self.slot + torch.arange(
            key_states.shape[2], device=self.slot.device)
        # an index_put_ (not index_copy_): torch.compile keeps it in place instead of copying the whole cache
        self.keys[layer_idx][:, :, positions] = key_states
        self.values[layer_idx][:, :, positions] = value_states
        return self.keys[layer_idx], self.values[layer_idx]

    # older transformers ask; positions are always passed
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def allocate(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        """Allocates every layer now (else the first write does), zeroed."""
        shape = (self.rows, kv_heads, self.width, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=self.slot.device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=self.slot.device) for _ in range(layers)]

    def repeated(self, repeats: int, width: int) -> StaticKVCache:
        """A cache of ``rows * repeats`` rows and ``width`` slots holding this one's slots, each row
        repeated ``repeats`` times (rows ``b*repeats ..`` copy row b)."""
        out = StaticKVCache(self.rows * repeats, width, self.slot.device)
        for source, target in ((self.keys, out.keys), (self.values, out.values)):
            for layer in source:
                full = layer.new_zeros((out.rows, layer.shape[1], width, layer.shape[3]))
                full[:, :, :layer.shape[2]] = layer.repeat_interleave(repeats, 0)
                target.append(full)
        out.slot.fill_(self.width)
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def _cache_keyword(model: nn.Module) -> dict[str, str]:
    """The keyword the decoder takes its cache under (``cache`` since transformers 5.2x, else
    ``past_key_values``), and whether it takes ``cache_position``."""
    decoder = model.get_decoder()
    params = inspect.signature(decoder.forward).parameters
    return {"cache": "cache" if "cache" in params else "past_key_values",
            "cache_position": "cache_position" if "cache_position" in params else ""}


class StaticDecoder:
    """The buffers and the one-token step of one static decoding call (see the module docstring).

    Args:
        model: the decoder LM (eval mode, no gradient).
        ids, mask: [B, P] left-padded prompts.
        repeats: completions per prompt (rows ``b*repeats ..`` belong to prompt b).
        max_new_tokens: C, the completion budget.
        eos_ids, pad_id: the ids that end a row, and the id written after its end.
        draw: the token draw.
        row_offset, total_rows: these rows' place among the step's rows (data parallel).
    """

    def __init__(self, model: nn.Module, ids: Tensor, mask: Tensor, *, repeats: int, max_new_tokens: int,
                 eos_ids: Sequence[int], pad_id: int, draw: TokenDraw, row_offset: int = 0,
                 total_rows: int | None = None) -> None:
        self.model, self.draw, self.pad_id = model, draw, pad_id
        self.inputs = (ids, mask)
        self.options = dict(repeats=repeats, max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id,
                            draw=draw, row_offset=row_offset, total_rows=total_rows)
        self.row_offset, self.total_rows = row_offset, total_rows
        device = ids.device
        b, p = ids.shape
        n = b * repeats
        self.rows, self.max_new_tokens = n, max_new_tokens
        self.width = p + max_new_tokens  # slots 0 .. P-2: the prompt head; P-1+t: the token fed at step t
        self.keywords = _cache_keyword(model)
        self.eager_attention = (getattr(model.config, "_attn_implementation", None) or "eager") == "eager"
        self.dtype = next(model.parameters()).dtype if self.eager_attention else torch.bool
        # the prompt head (all tokens but the last), once per distinct prompt
        head = StaticKVCache(b, max(p - 1, 0), device)
        if p > 1:
            head_mask = mask[:, :-1]
            allowed = attention_mask(prompt_attention(head_mask), self.eager_attention, self.dtype)
            self._forward(ids[:, :-1], allowed, position_ids_from_mask(head_mask), head, logits_to_keep=1)
        self.cache = head.repeated(repeats, self.width)
        if not self.cache.keys:  # one-token prompts: nothing prefilled; allocate before any step is traced
            config = model.config
            heads = config.num_attention_heads
            self.cache.allocate(config.num_hidden_layers,
                                getattr(config, "num_key_value_heads", None) or heads,
                                getattr(config, "head_dim", None) or config.hidden_size // heads,
                                model.get_input_embeddings().weight.dtype)
        # the step's buffers
        # the mask, in the form grouped_attention takes
        self.attention = torch.zeros(n, 1, 1, self.width, dtype=torch.bool, device=device)
        self.attention[:, 0, 0, :p - 1] = mask[:, :-1].repeat_interleave(repeats, 0)
        self.token = ids[:, -1].repeat_interleave(repeats, 0).clone()  # [n]: fed at the next step
        self.position = position_ids_from_mask(mask)[:, -1].repeat_interleave(repeats, 0).clone()  # [n]
        self.t = torch.zeros(1, dtype=torch.long, device=device)  # the column the next token goes to
        self.u = torch.ones(n, 2, dtype=torch.float64, device=device)
        self.eos = torch.tensor(list(eos_ids), device=device)
        self.done = torch.zeros(n, dtype=torch.bool, device=device)
        # a live row whose step was no distribution
        self.bad = torch.zeros(n, dtype=torch.bool, device=device)
        self.ids = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=device)
        self.logprobs = (torch.zeros((n, max_new_tokens), dtype=torch.float32, device=device)
                         if draw.logprobs else None)

    def _forward(self, ids: Tensor, attention: Tensor, position: Tensor, cache: StaticKVCache, *,
                 logits_to_keep: int) -> Tensor:
        kwargs = {self.keywords["cache"]: cache}
        if self.keywords["cache_position"]:  # transformers 4.x builds positions from it when asked
            kwargs["cache_position"] = cache.slot + torch.arange(ids.shape[1], device=ids.device)
        out = self.model(input_ids=ids, attention_mask=attention, position_ids=position, use_cache=True,
                         logits_to_keep=logits_to_keep, **kwargs)
        return out.logits[:, -1]

    def restarted(self) -> StaticDecoder:
        """A fresh decoder for the same call (after a failed capture)."""
        return StaticDecoder(self.model, *self.inputs, **self.options)

    def fill_uniforms(self) -> None:
        """This step's uniforms for every row (inside the graph under ``cuda_graph``)."""
        if self.draw.needs_uniforms:
            self.u.copy_(draw_uniforms(self.rows, self.u.device, row_offset=self.row_offset,
                                       total_rows=self.total_rows))

    def step(self) -> None:
        """Feeds ``token`` at ``cache.slot``, draws the next token into column ``t``; every read and
        write is a preallocated buffer, so the step can be captured and replayed. Runs inside
        :func:`_grouped_attention`."""
        slot = self.cache.slot
        self.attention.index_fill_(3, slot, True)  # the fed token attends to itself
        logits = self._forward(self.token[:, None], self.attention, self.position[:, None], self.cache,
                               logits_to_keep=1)
        token, logprob, ok = self.draw(logits, self.u)
        live = ~self.done
        self.bad.logical_or_(live & ~ok)  # in place, no attribute written: the compiled graph returns nothing
        token = torch.where(live, token, self.pad_id)
        self.ids.index_copy_(1, self.t, token[:, None])
        if self.logprobs is not None:
            self.logprobs.index_copy_(1, self.t, torch.where(live, logprob, 0.0)[:, None])
        # (torch.isin may sort, and sync, for many EOS ids)
        self.done.logical_or_((token[:, None] == self.eos).any(-1))
        self.token.copy_(token)
        self.position.add_(1)
        slot.add_(1)
        self.t.add_(1)


_COMPILED_STEPS: dict[str, object] = {}  # device type -> the compiled step
# (graph, arguments, outputs) of each run of a compiled graph of the step inside _first_compiled_step; None
# elsewhere, so that no run outside it keeps its tensors (a KV cache) alive
_GRAPH_RUNS: list[list[tuple[Callable, tuple, object]] | None] = [None]


def _recording_backend(options: dict | None):
    """Inductor (``compile_fx``, as ``torch.compile``'s default backend) with each compiled graph wrapped
    to record its runs in ``_GRAPH_RUNS`` while :func:`_first_compiled_step` runs: the arguments dynamo
    passes it are the step's tensors, read from the decoder and the model. None where this torch has no
    ``compile_fx``."""
    try:
        from torch._inductor.compile_fx import compile_fx
    except ImportError:
        return None

    def backend(graph_module, example_inputs):
        graph = compile_fx(graph_module, example_inputs, config_patches=options)

        def run(*args):
            out = graph(*args)
            if _GRAPH_RUNS[0] is not None:
                _GRAPH_RUNS[0].append((graph, args, out))
            return out
        return run
    return backend


def _compiled_step(device_type: str):
    """The step through ``torch.compile``; on the CPU with inductor's C++ wrapper, which calls the step's
    kernels from C++ rather than Python (a token step is many small kernels there)."""
    if device_type not in _COMPILED_STEPS:
        options = {"cpp_wrapper": True} if device_type == "cpu" else None
        backend = _recording_backend(options)
        _COMPILED_STEPS[device_type] = (torch.compile(StaticDecoder.step, dynamic=False, backend=backend)
                                        if backend is not None else
                                        torch.compile(StaticDecoder.step, dynamic=False, options=options))
    return _COMPILED_STEPS[device_type]


def _first_compiled_step(step, decoder: StaticDecoder) -> Callable[[], object] | None:
    """Runs the call's first step through ``torch.compile``, every guard checked, and returns the graph
    that ran bound to the arguments dynamo gave it, for the call's later steps; or None (the later steps
    go through ``torch.compile``) unless the step ran as one graph that returned nothing.

    Calling the graph directly skips dynamo's guards and the code around the graph (about 0.2 ms a token
    on the CPU). It is exact because every later step of the call reads and writes the same tensors, in
    place, with the same shapes, under the same modules (the step changes no Python state), and a graph
    that returns nothing leaves dynamo nothing to write back."""
    runs = _GRAPH_RUNS[0] = []
    try:
        step(decoder)
    finally:
        _GRAPH_RUNS[0] = None
    if len(runs) != 1 or runs[0][2] not in (None, (), []):
        return None
    graph, args, _ = runs[0]
    return functools.partial(graph, *args)


def _later_steps() -> contextlib.AbstractContextManager:
    """torch.compile skipping the guards that do not tell compiled graphs apart (torch 2.7+), or nothing."""
    try:
        return torch.compiler.set_stance(skip_guard_eval_unsafe=True)
    except (AttributeError, TypeError):
        return contextlib.nullcontext()


def _warm_up(decoder: StaticDecoder, steps: int = 2) -> None:
    """Runs uniforms + step ``steps`` times and puts back every buffer the next step reads (the
    writes to slot P-1 and column 0 are overwritten by the first real step)."""
    start = {name: getattr(decoder, name).clone() for name in ("token", "position", "t", "done", "bad")}
    slot = decoder.cache.slot.clone()
    for _ in range(steps):
        decoder.fill_uniforms()
        decoder.step()
        for name, value in start.items():
            getattr(decoder, name).copy_(value)
        decoder.cache.slot.copy_(slot)


def _capture(decoder: StaticDecoder) -> torch.cuda.CUDAGraph:
    """Warms the step up on a side stream (as CUDA-graph capture requires), then captures uniforms +
    step as one CUDA graph; capturing records the kernels without running them."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _warm_up(decoder)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoder.fill_uniforms()
        decoder.step()
    return graph


@torch.no_grad()
def decode_static(model: nn.Module, ids: Tensor, mask: Tensor, *, repeats: int, max_new_tokens: int,
                  eos_ids: Sequence[int], pad_id: int, draw: TokenDraw, mode: Mode = "eager",
                  check_every: int | None = None, clock: PhaseClock | None = None,
                  info: dict | None = None, row_offset: int = 0, total_rows: int | None = None
                  ) -> tuple[Tensor, Tensor | None]:
    """Completions of the left-padded prompts ``ids`` / ``mask`` [B, P], each repeated ``repeats``
    times, on the static path; same contract as :func:`grpo_engine.sampling.decode.decode`.

    Args:
        mode: ``"eager"``, ``"compiled"`` (``torch.compile``) or ``"cuda_graph"`` (CUDA only; falls
            back to eager with a warning when the step cannot be captured).
        check_every: tokens between host checks of the EOS flags (default 16 on CUDA, 1 on the CPU,
            where a check costs nothing and a finished batch should stop at once).
        clock: marked "prefill" once the cache is filled (and the graph captured), "decode" at the end.
        info: when given, filled with ``path`` (the mode that ran), ``capture_error`` (why a CUDA
            graph could not be captured, or None) and ``direct_steps`` (``"compiled"``: the steps that
            called the first step's compiled graph directly, :func:`_first_compiled_step`).
        row_offset, total_rows: these rows' place among the step's rows (data parallel), as in ``decode``.

    Raises:
        ValueError: a step's logits were not a distribution (checked at the host checks).
    """
    if mode == "cuda_graph" and ids.device.type != "cuda":
        raise ValueError(f"mode='cuda_graph' needs the model on a CUDA device, not {ids.device}; "
                         "use 'eager' or 'compiled' on the CPU")
    check_every = check_every or (16 if ids.device.type == "cuda" else 1)
    decoder = StaticDecoder(model, ids, mask, repeats=repeats, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                            pad_id=pad_id, draw=draw, row_offset=row_offset, total_rows=total_rows)
    graph, ran, capture_error = None, mode, None
    if mode == "cuda_graph":
        try:
            with _grouped_attention(model):
                graph = _capture(decoder)
        except Exception as error:  # a model whose step cannot be captured still samples
            capture_error = f"{type(error).__name__}: {str(error)[:300]}"
            warnings.warn(f"could not capture the decoding step as a CUDA graph ({capture_error}); decoding "
                          "without it", stacklevel=2)
            torch.cuda.synchronize()
            # the prefill runs again, outside the grouped attention
            decoder, ran = decoder.restarted(), "static"
    if info is not None:
        info.update(path=ran if ran != "eager" else "static", capture_error=capture_error, direct_steps=0)
    step = _compiled_step(ids.device.type) if mode == "compiled" else StaticDecoder.step
    if clock is not None:
        clock.mark("prefill")
    direct = None  # the compiled graph, called without torch.compile after the first step
    with _grouped_attention(model), contextlib.ExitStack() as stack:
        for t in range(max_new_tokens):
            if t == 1 and mode == "compiled" and direct is None:
                # the first step checked every guard; the later steps of this call pass the same objects and
                # shapes, so only the guards that tell compiled graphs apart run
                stack.enter_context(_later_steps())
            if graph is not None:
                graph.replay()
            else:
                decoder.fill_uniforms()
                if direct is not None:
                    direct()
                elif t == 0 and mode == "compiled":
                    direct = _first_compiled_step(step, decoder)
                else:
                    step(decoder)
            if (t + 1) % check_every == 0 or t == max_new_tokens - 1:
                if decoder.bad.any():
                    raise ValueError(BAD_DISTRIBUTION)
                if decoder.done.all():
                    break
    if clock is not None:
        clock.mark("decode")
    if info is not None and direct is not None:
        info["direct_steps"] = t
    return decoder.ids, decoder.logprobs
