"""The dynamic decoding loop of HFSampler and greedy evaluation.

- One forward per new token, over the rows still running: a row that emits an EOS token leaves the
  batch (its KV-cache rows are dropped), so a finished completion costs nothing more. (The fixed-shape
  path for GPUs, a static KV cache and a CUDA graph, is :mod:`grpo_engine.sampling.static`.)
- The prompt's KV cache is filled once per distinct prompt and repeated across its group (``repeats``);
  the last prompt token is the first token of the loop.
- The token draw both paths share (:class:`TokenDraw`, :func:`draw_uniforms`, :class:`PhaseClock`) is
  :mod:`grpo_engine.sampling.draw`, re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from grpo_engine.ops.attention import is_decoder_lm, kv_cache, position_ids_from_mask
from grpo_engine.sampling.draw import (
    BAD_DISTRIBUTION,
    BLOCK,
    PhaseClock,
    TokenDraw,
    categorical,
    draw_uniforms,
    inverse_cdf,
    sample_categorical,
    seeded_rng,
)

__all__ = ["TokenDraw", "PhaseClock", "categorical", "sample_categorical", "inverse_cdf", "decode",
           "is_decoder_lm", "completion_mask_from_ids", "draw_uniforms", "seeded_rng", "BAD_DISTRIBUTION",
           "BLOCK"]


def _supports(cache, method: str) -> bool:
    """Whether a transformers cache and every one of its layers implement ``method``."""
    layers = getattr(cache, "layers", None)
    return hasattr(cache, method) and layers is not None and all(hasattr(layer, method) for layer in layers)


def _prefill(model: nn.Module, ids: Tensor, mask: Tensor, repeats: int) -> dict:
    """The KV cache of every prompt token but the last, as the keyword the model takes it, with
    each row repeated ``repeats`` times; {} when there is no such token."""
    if ids.shape[1] < 2:
        return {}
    head_ids, head = ids[:, :-1], mask[:, :-1].long()
    out = model(input_ids=head_ids, attention_mask=head, position_ids=position_ids_from_mask(head),
                use_cache=True, logits_to_keep=1)
    name, cache = kv_cache(out)
    if cache is None:
        raise ValueError(f"{type(model).__name__} returned no KV cache with use_cache=True; "
                         "the sampler needs one")
    if repeats > 1:
        # a cache that cannot repeat rows: one prefill per row
        if not _supports(cache, "batch_repeat_interleave"):
            return _prefill(model, ids.repeat_interleave(repeats, 0), mask.repeat_interleave(repeats, 0), 1)
        cache.batch_repeat_interleave(repeats)
    return {name: cache}


@torch.no_grad()
def decode(model: nn.Module, ids: Tensor, mask: Tensor, *, repeats: int, max_new_tokens: int,
           eos_ids: Sequence[int], pad_id: int, draw: TokenDraw, clock: PhaseClock | None = None,
           row_offset: int = 0, total_rows: int | None = None, draw_rows: Tensor | None = None,
           stop: Callable[[Tensor, Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
    """Completions of the left-padded prompts ``ids`` / ``mask`` [B, P], each repeated ``repeats``
    times (rows ``b*repeats ..`` belong to prompt b), one token per step chosen by ``draw``.
    ``row_offset`` / ``total_rows``: these rows' place among all the rows of the step (data parallel),
    whose uniforms every step draws (:func:`draw_uniforms`). ``draw_rows`` [B*repeats], instead: the
    row of the step's draw each row takes (rows that are not contiguous: a multi-turn rollout's turn).
    ``stop(ids, rows) -> [r] bool``, when given, is asked after each token with the running rows' ids so
    far [r, t] and their output rows [r]; a row it answers True for ends there, like an EOS.

    Returns:
        ids [B*repeats, C] (``pad_id`` after a row's EOS token, which is kept) and the log-probs
        ``draw`` reported [B*repeats, C] (0 after the EOS), or None when it reports none.
        ``clock``, when given, is marked "prefill" after the prompt's prefill and "decode" at the end.

    Raises:
        ValueError: a step's logits were not a distribution (NaN / inf, or top-k / top-p kept nothing).
    """
    n = ids.shape[0] * repeats
    device = ids.device
    out_ids = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=device)
    out_logprobs: Tensor | None = None
    eos = torch.tensor(list(eos_ids), device=device)
    cache = _prefill(model, ids, mask, repeats)
    if clock is not None:
        clock.mark("prefill")
    attention = mask.long().repeat_interleave(repeats, 0)  # [n, P]: the cache plus the token fed next
    position = position_ids_from_mask(attention)[:, -1]  # [n]
    token = ids[:, -1].repeat_interleave(repeats, 0)  # [n]
    rows = torch.arange(n, device=device)  # the output row of each running row
    done = torch.zeros(n, dtype=torch.bool, device=device)  # each running row: has it emitted an EOS?
    lengths = torch.full((n,), max_new_tokens, device=device)  # where stop() ended a row
    prune = True
    for t in range(max_new_tokens):
        out = model(input_ids=token[:, None], attention_mask=attention, position_ids=position[:, None],
                    use_cache=True, logits_to_keep=1, **cache)
        # draw the uniforms of every row, as static decoding does, then keep the running rows'
        u = None
        if draw.needs_uniforms and draw_rows is None:
            u = draw_uniforms(n, device, row_offset=row_offset, total_rows=total_rows)[rows]
        elif draw.needs_uniforms:
            u = draw_uniforms(total_rows, device)[draw_rows[rows]]
        token, logprobs, ok = draw(out.logits[:, -1], u)
        if not ok.all():
            raise ValueError(BAD_DISTRIBUTION)
        out_ids[rows, t] = token
        if logprobs is not None:
            if out_logprobs is None:
                out_logprobs = torch.zeros((n, max_new_tokens), dtype=logprobs.dtype, device=device)
            out_logprobs[rows, t] = logprobs
        done = done | torch.isin(token, eos)
        if stop is not None:
            ended = stop(out_ids[rows, :t + 1], rows).to(device)
            lengths[rows[ended & ~done]] = t + 1
            done = done | ended
        if t == max_new_tokens - 1 or done.all():
            break
        name, cache_now = kv_cache(out)
        cache = {name: cache_now}
        prune = prune and _supports(cache_now, "batch_select_indices")
        if prune and done.any():
            keep = (~done).nonzero().squeeze(1)
            cache_now.batch_select_indices(keep)
            rows, token, done = rows[keep], token[keep], done[keep]
            attention, position = attention[keep], position[keep]
        attention = torch.cat([attention, attention.new_ones(len(rows), 1)], dim=1)
        position = position + 1
    if clock is not None:
        clock.mark("decode")
    if not prune:  # rows ran on after their EOS (or their stop): blank what followed it
        keep, _ = completion_mask_from_ids(out_ids, eos_ids)
        keep &= torch.arange(max_new_tokens, device=device)[None, :] < lengths[:, None]
        out_ids = out_ids.masked_fill(~keep, pad_id)
        out_logprobs = out_logprobs.masked_fill(~keep, 0.0) if out_logprobs is not None else None
    return out_ids, out_logprobs


def completion_mask_from_ids(completion_ids: Tensor, eos_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Mask [N, C] (True up to and including the first EOS) and truncation flags [N].

    Example:
        >>> mask, trunc = completion_mask_from_ids(torch.tensor([[5, 1, 0], [5, 6, 7]]), [1])
        >>> mask.tolist(), trunc.tolist()
        ([[True, True, False], [True, True, True]], [False, True])
    """
    is_eos = torch.isin(completion_ids, torch.tensor(list(eos_ids), device=completion_ids.device))
    has_eos = is_eos.any(dim=1)
    eos_before = is_eos.long().cumsum(dim=1) - is_eos.long()  # EOS tokens strictly before t
    mask = eos_before == 0
    return mask, ~has_eos
