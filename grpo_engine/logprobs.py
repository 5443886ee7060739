"""Per-token log-probs of completion tokens without ever holding the [N, T, V] logits.

The decoder runs once and returns hidden states [n, T, H]. Only those that predict a kept completion
token are gathered (prompt and padding positions are never projected); the lm_head projection and the
log-softmax at the sampling temperature then run over chunks of ``chunk_size`` tokens. With gradients
each chunk is checkpointed, so the backward recomputes its logits: at most ``chunk_size * V`` logits
exist, never ``n * T * V`` (with ``vocab_tile`` a plain linear head is also cut into vocabulary tiles).

    log p(y_t) = z_{y_t} / tau - logsumexp(z / tau),   z = lm_head(h_{t-1}) in float32

Position ids are ``cumsum(attention_mask) - 1`` for left-padded prompts, as in the sampler's decoding
loop, so the log-probs equal the sampler's. With ``share_prompt`` the decoder runs once over each
distinct prompt (with gradients), its KV cache is gathered to the rows, and a second call runs only the
completion tokens against it: the prompt's forward and backward cost one row per group instead of G,
and the result equals the full pass up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from grpo_engine.compiling import compiled_hidden
from grpo_engine.ops.attention import (
    completion_attention,
    decoder_masks,
    kv_cache,
    position_ids_from_mask,
    prompt_attention,
)
from grpo_engine.vocab_tiled import cast_head_weight, tiled_linear_logprobs

__all__ = ["completion_logprobs", "selective_logprobs", "position_ids_from_mask", "can_share_prompt",
           "kv_cache", "TokenIndex", "to_device", "keeps_cache"]


def _softcap(model: nn.Module) -> float | None:
    config = getattr(model, "config", None)
    return getattr(config, "final_logit_softcapping", None) if config is not None else None


def _chunk_logprobs(hidden: Tensor, weight_fn: nn.Module, targets: Tensor, temperature: float,
                    softcap: float | None, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    logits = weight_fn(hidden).float()  # [k, V]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits / temperature
    norm = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - norm
    if not with_entropy:
        return logprobs, None
    entropy = norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # H = logZ - E_p[z]
    return logprobs, entropy


def selective_logprobs(
    hidden: Tensor,
    lm_head: nn.Module,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    softcap: float | None = None,
    with_entropy: bool = False,
    vocab_tile: int | None = None,
    entropy_grad: bool = False,
    compiled: bool = False,
    keep_logits: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probs of ``targets`` (and optionally the token entropy) from hidden states, chunk by chunk.

    Args:
        hidden: [k, H] hidden states, each predicting the target at the same index.
        lm_head: the output projection (a LoRA-wrapped one works too).
        targets: [k] token ids.
        temperature: logits are divided by it before the softmax.
        chunk_size: tokens per chunk; bounds the logits memory to ``chunk_size * V``.
        softcap: Gemma-2-style final logit soft-capping, when the model uses it.
        with_entropy: also return the entropy of each position's distribution (same pass, no
            extra forward), ``H = logsumexp(z) - sum softmax(z) * z`` at the temperature.
        vocab_tile: when set and the head is a plain ``nn.Linear`` (no soft-capping), each chunk
            also runs over the vocabulary in tiles of this size (``grpo_engine.vocab_tiled``), so
            at most ``chunk_size * vocab_tile`` logits exist in the forward and the backward.
        entropy_grad: the entropy must carry a gradient (an entropy bonus); the tiled path gives
            the entropy without one, so this selects the checkpointed chunks.
        compiled: the tiled path's element-wise work through ``torch.compile``.
        keep_logits: when the tokens fit in one chunk and the vocabulary in one tile, the tiled pass
            keeps its logits for the backward pass instead of recomputing them
            (``grpo_engine.vocab_tiled``): for a caller whose backward pass comes next, as the
            trainer's does.

    Returns:
        [k] float32 log-probs, or ``(logprobs [k], entropy [k])`` with ``with_entropy``.

    Example:
        >>> head = torch.nn.Linear(4, 10, bias=False)
        >>> selective_logprobs(torch.randn(3, 4), head, torch.tensor([1, 2, 3]), chunk_size=2).shape
        torch.Size([3])
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1; use e.g. 1024")
    tiled = (bool(vocab_tile) and type(lm_head) is nn.Linear and softcap is None
             and not (with_entropy and entropy_grad))
    logprobs, entropies = [], []
    cast = cast_head_weight(hidden, lm_head) if tiled and hidden.shape[0] else None  # once, every chunk's
    for start in range(0, hidden.shape[0], chunk_size):
        h = hidden[start:start + chunk_size]
        t = targets[start:start + chunk_size]
        if tiled:
            lp, ent = tiled_linear_logprobs(h, lm_head, t, temperature=temperature, vocab_tile=vocab_tile,
                                            compiled=compiled, cast_weight=cast,
                                            keep_logits=keep_logits and hidden.shape[0] <= chunk_size)
        elif torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(_chunk_logprobs, h, lm_head, t, temperature, softcap, with_entropy,
                                 use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(h, lm_head, t, temperature, softcap, with_entropy)
        logprobs.append(lp)
        entropies.append(ent)
    empty = hidden.new_zeros(0, dtype=torch.float32)
    out = torch.cat(logprobs) if logprobs else empty
    if not with_entropy:
        return out
    return out, (torch.cat(entropies) if entropies else empty)


def completion_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    vocab_tile: int | None = None,
    entropy_grad: bool = False,
    share_prompt: bool = False,
    score_mask: Tensor | None = None,
    compiled: bool = False,
    keep_logits: bool = False,
    index: TokenIndex | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probs of each kept completion token under ``model`` (and optionally the token entropy).

    Args:
        model: a transformers causal LM (or a peft model wrapping one).
        prompt_ids: [n, P] left-padded prompt ids.
        prompt_mask: [n, P] True on real prompt tokens.
        completion_ids: [n, C] right-padded completion ids.
        completion_mask: [n, C] True on tokens to score.
        temperature: the sampling temperature.
        chunk_size: tokens per lm_head chunk.
        with_entropy: also return the [n, C] entropy of each position's next-token distribution.
        vocab_tile, entropy_grad, keep_logits: see :func:`selective_logprobs`.
        share_prompt: run each distinct prompt once and reuse its KV cache for every row that has
            it (see the module docstring); ignored where :func:`can_share_prompt` says no.
        score_mask: [n, C] the tokens to score, within ``completion_mask`` (default: all of them);
            the others are attended to (a tool's answer in a multi-turn rollout) but get 0.
        compiled: run the decoder layers through ``torch.compile``
            (:func:`grpo_engine.compiling.compiled_hidden`; the trainer's ``compile_training``).
        index: where the scored tokens and the distinct prompts are (:class:`TokenIndex`), worked out by
            the caller on the host; default: worked out here, which reads the masks back from the device
            (on a GPU: waits for it). With it, and a model whose attention takes a 4D mask, the pass never
            waits for the device.

    Returns:
        [n, C] float32 log-probs, 0 where ``completion_mask`` (or ``score_mask``) is False; with
        ``with_entropy``, ``(logprobs, entropy)``, both [n, C].
    """
    n, num_prompt = prompt_ids.shape
    keep = completion_mask.bool() if score_mask is None else score_mask.bool() & completion_mask.bool()
    if index is None:  # worked out here: reading the masks back from the device synchronises once
        index = TokenIndex.of(prompt_ids, prompt_mask, keep,
                              share=share_prompt and keeps_cache(model, prompt_ids))
    # the last completion token predicts nothing that is scored: the decoder is fed the others
    fed_ids, fed_mask = completion_ids[:, :-1], completion_mask[:, :-1]
    inputs = (prompt_ids, prompt_mask, fed_ids, fed_mask)
    if compiled:
        predicting = compiled_hidden(model, *inputs, distinct=index.distinct)
    elif index.distinct is not None:
        predicting = _shared_prompt_hidden(model, *inputs, *index.distinct, dense=index.dense)
    else:
        attention_mask = torch.cat([prompt_mask, fed_mask], dim=1)  # [n, P + C - 1]
        out = model.get_decoder()(
            input_ids=torch.cat([prompt_ids, fed_ids], dim=1),
            **decoder_masks(model, attention_mask, prompt_attention(attention_mask)),
            use_cache=False,
        )
        # position t-1 predicts completion token t
        predicting = _last_hidden(out)[:, num_prompt - 1:]  # [n, C, H]
    # the scored tokens, gathered at positions the host worked out (a boolean index would read back a count)
    selected = selective_logprobs(
        predicting.flatten(0, 1).index_select(0, index.kept),
        model.get_output_embeddings(),
        completion_ids.flatten().index_select(0, index.kept),
        temperature=temperature,
        chunk_size=chunk_size,
        softcap=_softcap(model),
        with_entropy=with_entropy,
        vocab_tile=vocab_tile,
        entropy_grad=entropy_grad,
        compiled=compiled,
        keep_logits=keep_logits,
    )
    zeros = torch.zeros(completion_ids.numel(), dtype=torch.float32, device=completion_ids.device)
    place = lambda values: zeros.scatter(0, index.kept, values).view(completion_ids.shape)  # noqa: E731
    return place(selected) if not with_entropy else (place(selected[0]), place(selected[1]))


@dataclass(frozen=True)
class TokenIndex:
    """Where a log-prob pass's tokens are, worked out on the host before the pass, so that the pass reads
    nothing back from the device (a boolean index, ``unique`` or ``.item()`` in it would wait for the GPU).

    Attributes:
        kept: [k] long, on the pass's device: the flat positions ``row * C + column`` of the scored tokens
            of the [n, C] completions, in row-major order.
        distinct: ``(first row of each distinct prompt [u], the distinct prompt of each row [n])`` on the
            device when the prompt runs once per distinct prompt, else None.
        dense: no prompt token is padding and every completion token is scored: a decoder pass with a
            KV cache then needs no mask (``ops.attention.decoder_masks``).

    Example:
        >>> keep = torch.tensor([[True, False], [True, True]])
        >>> TokenIndex.of(torch.tensor([[5], [5]]), torch.ones(2, 1, dtype=torch.bool), keep, share=True)
        TokenIndex(kept=tensor([0, 2, 3]), distinct=(tensor([0]), tensor([0, 0])), dense=False)
    """

    kept: Tensor
    distinct: tuple[Tensor, Tensor] | None = None
    dense: bool = False

    @staticmethod
    def of(prompt_ids: Tensor | None, prompt_mask: Tensor, keep: Tensor, *, share: bool,
           device: torch.device | str | None = None) -> TokenIndex:
        """The index of ``keep`` [n, C] (the tokens to score) and, with ``share``, of the distinct prompts
        ``prompt_ids`` / ``prompt_mask`` [n, P] when some repeat (``prompt_ids`` may be None without
        ``share``); computed on CPU copies (one read back, for tensors on a GPU), placed on ``device``
        (default: ``keep``'s), with one non-blocking copy each."""
        device = torch.device(device) if device is not None else keep.device
        kept = keep.cpu().reshape(-1).nonzero().squeeze(1)
        share = share and prompt_ids is not None and prompt_ids.shape[0] > 1 and prompt_ids.shape[1] > 0
        distinct = _distinct_rows(prompt_ids.cpu(), prompt_mask.cpu()) if share else None
        if distinct is not None and len(distinct[0]) == prompt_ids.shape[0]:
            distinct = None  # every prompt distinct: nothing to share
        if distinct is not None:
            distinct = (to_device(distinct[0], device), to_device(distinct[1], device))
        dense = bool(prompt_mask.cpu().all()) and kept.numel() == keep.numel()
        return TokenIndex(to_device(kept, device), distinct, dense)


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """A CPU tensor on ``device`` without waiting for it: through pinned memory, non-blocking, on a GPU (a
    plain copy from pageable memory waits for the stream); itself on the CPU."""
    if device.type == "cpu" or tensor.device == device:
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def _last_hidden(out) -> Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _distinct_rows(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(first row of each distinct prompt [u], the distinct prompt of each row [n])."""
    keyed = torch.cat([prompt_ids, prompt_mask.long()], dim=1)
    _, inverse = torch.unique(keyed, dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), prompt_ids.shape[0], dtype=torch.long,
                       device=inverse.device)
    first = first.scatter_reduce(0, inverse, torch.arange(len(inverse), device=inverse.device), reduce="amin")
    return first, inverse


def keeps_cache(model: nn.Module, prompt_ids: Tensor | None = None) -> bool:
    """Whether the decoder keeps its KV cache in this mode (transformers drops it under gradient
    checkpointing in training), and, given ``prompt_ids`` [n, P], whether there is a prompt to share."""
    if prompt_ids is not None and (prompt_ids.shape[0] < 2 or prompt_ids.shape[1] < 1):
        return False
    checkpointing = any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
    return not (checkpointing and model.training and torch.is_grad_enabled())


def can_share_prompt(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor) -> bool:
    """Whether the prompt-sharing pass applies: rows repeat a prompt, and the decoder keeps its KV
    cache in this mode (transformers drops the cache under gradient checkpointing in training)."""
    return (keeps_cache(model, prompt_ids)
            and len(_distinct_rows(prompt_ids, prompt_mask)[0]) < prompt_ids.shape[0])


def _shared_prompt_hidden(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, fed_ids: Tensor,
                          fed_mask: Tensor, first: Tensor, inverse: Tensor, *, dense: bool) -> Tensor:
    """[n, C, H] hidden states predicting each completion token, given the completion's first C - 1
    tokens ``fed_ids`` / ``fed_mask``; the prompt runs once per distinct prompt (``first``, ``inverse``:
    from :func:`_distinct_rows`); ``dense``: no token is padding."""
    decoder = model.get_decoder()
    head_mask = prompt_mask[first]  # [u, P]
    cached = fed_ids.shape[1] > 0  # the completion tokens attend to the prompt's KV cache
    out = decoder(input_ids=prompt_ids[first],
                  **decoder_masks(model, head_mask, prompt_attention(head_mask), dense=dense and cached),
                  use_cache=cached)
    last_prompt = _last_hidden(out)[:, -1][inverse]  # [n, H]: predicts completion token 0
    if fed_ids.shape[1] == 0:  # one-token completions
        return last_prompt[:, None]
    name, cache = kv_cache(out)
    cache.batch_select_indices(inverse)  # [u, ...] -> [n, ...]; differentiable gathers
    attention = torch.cat([prompt_mask, fed_mask], dim=1)  # [n, P + C - 1]
    rest = decoder(input_ids=fed_ids,
                   **decoder_masks(model, attention, completion_attention(prompt_mask, fed_mask), dense=dense,
                                   offset=prompt_ids.shape[1]), use_cache=True, **{name: cache})
    return torch.cat([last_prompt[:, None], _last_hidden(rest)], dim=1)
