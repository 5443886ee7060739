"""The buffers and the one-token step of static decoding (the runner is :mod:`grpo_engine.sampling.static`).

- :class:`StaticKVCache`: ``rows`` x ``width`` slots per layer, allocated once and written in place at a
  slot index held in a device tensor; keys are masked by a 4D attention mask kept in a buffer, so no
  shape depends on the step.
- :class:`StaticDecoder`: every buffer a step reads or writes, sized once for ``rows`` and
  ``prompt_tokens + max_new_tokens`` slots. :meth:`~StaticDecoder.load` refreshes them in place for one
  call whose prompts may be shorter and rows fewer: slots 0 .. P-2 hold the call's prompt head (prefilled
  once per distinct prompt, each row repeated), slot P-1+t the token fed at step t; the rows past the
  call's are finished from the start (padding, ignored). :meth:`~StaticDecoder.step` feeds one token and
  draws the next without allocating a buffer or reading the host, so it can be captured and replayed.
- A step attends over the first ``width`` slots only (``step(width)``, ``width`` >= the slots written so
  far): :func:`grouped_attention` reads the keys up to the mask's width. :func:`attention_buckets` gives
  the widths one run uses (a graph each), so early tokens do not read the whole P + C cache.
- :func:`grouped_attention`: the query heads that share a KV head are one matrix product against that
  head's keys, so the cache is read once per step and never expanded to every query head.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from grpo_engine.sampling.draw import TokenDraw

__all__ = ["StaticKVCache", "StaticDecoder", "grouped_attention", "attention_buckets", "static_cache_bytes"]


def grouped_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor, *,
                      scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """Attention of ``query`` [n, h, q, d] over the first W slots of ``key`` / ``value`` [n, kv, >= W, d]
    (h a multiple of kv) under a boolean ``attention_mask`` [n, 1, q, W] (True = attend), with the h / kv
    query heads of a KV head stacked into one product, so the keys are read once and never repeated per
    head. The softmax runs in float32. Returns [n, q, h, d] (transformers' attention-interface layout).
    """
    n, h, q, d = query.shape
    width = attention_mask.shape[-1]
    key, value = key[:, :, :width], value[:, :, :width]  # the bucket the step attends to (a view)
    kv = key.shape[1]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    grouped = query.reshape(n, kv, (h // kv) * q, d)  # head i uses KV head i // (h / kv)
    scores = torch.matmul(grouped, key.transpose(-1, -2)).view(n, kv, h // kv, q, width).float() * scale
    scores = scores.masked_fill(~attention_mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype).view(n, kv, (h // kv) * q, width)
    out = torch.matmul(probs, value)  # [n, kv, h/kv * q, d]
    return out.view(n, h, q, d).transpose(1, 2), None


def attention_buckets(width: int, size: int | None = 128, most: int = 32) -> list[int]:
    """The attended widths of a run whose cache has ``width`` slots: multiples of ``size`` (doubled until
    there are at most ``most``), the last one ``width``; ``[width]`` when ``size`` is None (no buckets).

    Example:
        >>> attention_buckets(300), attention_buckets(300, None), len(attention_buckets(20_000))
        ([128, 256, 300], [300], 20)
    """
    if size is None or size >= width:
        return [width]
    while math.ceil(width / size) > most:
        size *= 2
    return [w for w in range(size, width, size)] + [width]


def static_cache_bytes(model_config, rows: int, width: int, dtype: torch.dtype) -> int:
    """Bytes of the static KV cache: ``rows`` x ``width`` slots x layers x (keys + values)."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    element = torch.empty((), dtype=dtype).element_size()
    return rows * width * model_config.num_hidden_layers * 2 * kv_heads * head_dim * element


class StaticKVCache:
    """Keys and values of every layer, each [rows, kv_heads, width, head_dim], allocated on the
    first write (or by :meth:`allocate`) and then written in place at ``slot`` ([1] long, on the device).

    The model calls ``update(keys, values, layer_idx, ...)`` from its attention layers (the one
    method of transformers' cache interface this path relies on) and attends over what it returns:
    every slot, with the 4D mask deciding which count (and its width how many are read).
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

    def allocate_like(self, probe: StaticKVCache) -> None:
        """Allocates every layer now, zeroed, with the heads, head size and dtypes of ``probe``'s layers (a
        cache a forward wrote)."""
        self.keys = [k.new_zeros((self.rows, k.shape[1], self.width, k.shape[3])) for k in probe.keys]
        self.values = [v.new_zeros((self.rows, v.shape[1], self.width, v.shape[3])) for v in probe.values]

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
    """The buffers and the one-token step of static decoding (see the module docstring), sized once.

    Args:
        model: the decoder LM (eval mode, no gradient).
        rows: the most rows a call may have.
        prompt_tokens, max_new_tokens: the longest prompt (P) and completion (C) a call may have; the
            cache has P + C slots.
        eos_ids, pad_id: the ids that end a row, and the id written after its end.
        draw: the token draw (its temperature is ignored: :meth:`load` writes each call's to a buffer).
    """

    def __init__(self, model: nn.Module, *, rows: int, prompt_tokens: int, max_new_tokens: int,
                 eos_ids: Sequence[int], pad_id: int, draw: TokenDraw) -> None:
        self.model, self.draw, self.pad_id = model, draw, pad_id
        self.rows, self.prompt_tokens, self.max_new_tokens = rows, prompt_tokens, max_new_tokens
        self.width = prompt_tokens + max_new_tokens
        self.keywords = _cache_keyword(model)
        self.eager_attention = (getattr(model.config, "_attn_implementation", None) or "eager") == "eager"
        # the prefill's mask: additive in the parameters' dtype for eager attention
        self.dtype = next(model.parameters()).dtype if self.eager_attention else torch.bool
        device = next(model.parameters()).device
        self.cache = StaticKVCache(rows, self.width, device)  # allocated by the first load()
        # the mask, in the form grouped_attention takes
        self.attention = torch.zeros(rows, 1, 1, self.width, dtype=torch.bool, device=device)
        self.token = torch.full((rows,), pad_id, dtype=torch.long, device=device)  # fed at the next step
        self.position = torch.zeros(rows, dtype=torch.long, device=device)
        self.t = torch.zeros(1, dtype=torch.long, device=device)  # the column the next token goes to
        self.u = torch.ones(rows, 2, dtype=torch.float64, device=device)
        self.temperature = torch.ones((), dtype=torch.float32, device=device)
        self.eos = torch.tensor(list(eos_ids), device=device)
        self.done = torch.ones(rows, dtype=torch.bool, device=device)
        self.bad = torch.zeros(rows, dtype=torch.bool, device=device)  # a live row's step was no distribution
        self.ids = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
        self.logprobs = (torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=device)
                         if draw.logprobs else None)

    def forward(self, ids: Tensor, attention: Tensor, position: Tensor, cache: StaticKVCache, *,
                logits_to_keep: int) -> Tensor:
        """The model's last-position logits [n, V] for ``ids`` written into ``cache`` at its slot."""
        kwargs = {self.keywords["cache"]: cache}
        if self.keywords["cache_position"]:  # transformers 4.x builds positions from it when asked
            kwargs["cache_position"] = cache.slot + torch.arange(ids.shape[1], device=ids.device)
        out = self.model(input_ids=ids, attention_mask=attention, position_ids=position, use_cache=True,
                         logits_to_keep=logits_to_keep, **kwargs)
        return out.logits[:, -1]

    def load(self, ids: Tensor, mask: Tensor, head: StaticKVCache | None, *, repeats: int,
             temperature: float) -> int:
        """Refreshes every buffer in place for the left-padded prompts ``ids`` / ``mask`` [B, P], each
        repeated ``repeats`` times (rows ``b*repeats ..`` belong to prompt b), sampled at ``temperature``,
        with ``head`` the keys and values of each distinct prompt's tokens but the last (None for one-token
        prompts; ``static.load`` prefills it); returns the call's rows B*repeats. Slots past the prompt keep
        an earlier call's values, masked off until a step writes them. The cache must be allocated
        (``cache.allocate_like``)."""
        b, p = ids.shape
        n = b * repeats
        if n > self.rows or p > self.prompt_tokens:
            raise ValueError(f"a call of {n} rows x {p} prompt tokens does not fit a static decoder of "
                             f"{self.rows} rows x {self.prompt_tokens} prompt tokens; build a larger one")
        self.attention.zero_()
        if head is not None:
            for whole, part in zip(self.cache.keys + self.cache.values, head.keys + head.values):
                whole[:n].view(b, repeats, *whole.shape[1:])[:, :, :, :p - 1].copy_(part[:, None])
            self.attention[:n, 0, 0, :p - 1] = mask[:, :-1].repeat_interleave(repeats, 0)
        self.cache.slot.fill_(p - 1)
        self.token.fill_(self.pad_id)
        self.token[:n] = ids[:, -1].repeat_interleave(repeats, 0)
        self.position.zero_()  # the last prompt token's: the real tokens before it (left padding)
        self.position[:n] = (mask.long().sum(-1) - 1).clamp(min=0).repeat_interleave(repeats, 0)
        self.t.zero_()
        self.done.fill_(True)  # the rows past the call's: finished, never drawn
        self.done[:n] = False
        self.bad.zero_()
        self.ids.fill_(self.pad_id)
        if self.logprobs is not None:
            self.logprobs.zero_()
        self.temperature.fill_(temperature)
        return n

    def fill_uniforms(self, uniforms: Tensor) -> None:
        """This step's uniforms [n, 2] for the call's first n rows."""
        self.u[:uniforms.shape[0]].copy_(uniforms)

    def step(self, width: int | None = None) -> None:
        """Feeds ``token`` at ``cache.slot`` attending over the first ``width`` slots (all when None; it
        must exceed the slot), and draws the next token into column ``t``; every read and write is a
        preallocated buffer, so the step can be captured and replayed. Runs inside the grouped attention
        (:func:`grouped_attention`)."""
        slot = self.cache.slot
        self.attention.index_fill_(3, slot, True)  # the fed token attends to itself
        attention = self.attention if width is None else self.attention[:, :, :, :width]
        logits = self.forward(self.token[:, None], attention, self.position[:, None], self.cache,
                              logits_to_keep=1)
        token, logprob, ok = self.draw(logits, self.u, temperature=self.temperature)
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

    def state(self) -> list[Tensor]:
        """The buffers a step changes that a later step reads (not the slots and columns it writes, which
        the next real step writes again): what a warm-up step must put back."""
        return [self.token, self.position, self.t, self.done, self.bad, self.cache.slot]
