"""Multi-turn generation on our decoding loop, each row's KV cache kept from one turn to the next (issue 54).

:class:`CachedTurns` is the :class:`~grpo_engine.sampling.turns.TurnGenerator` that
:class:`~grpo_engine.tools.rollout.ToolSampler` runs on a transformers causal LM. Prefilling each row's whole
context every turn costs T·P + c·T(T−1)/2 prefill tokens per row over T turns (P the prompt, c a turn and its
tool reply); keeping the cache costs P + (the environment's tokens):

- Between calls each row's cache (every layer's keys and values of its context, no padding) is held, keyed
  by the row's place, with the ids it holds. A context that extends what the row held plus what it sampled
  feeds only the rest: the previous turn's last sampled token (sampled, never fed) and the environment's
  tokens. A context that does not extend it starts afresh; a place absent from a call has finished and its
  cache is freed; :meth:`CachedTurns.reset` frees every one.
- A turn batches its rows: their caches right-aligned into one (zeros where a row holds fewer tokens,
  masked), the new tokens right-aligned after them (the padding in the middle, masked), each row's positions
  counting its own tokens: every real token attends to what it does in the re-prefill path, so the
  log-probs agree to float rounding (fp32: about 1e-6) and the tokens are the same.
- Then one forward per token over the rows still in their turn; a row whose turn ended (EOS, a stop text,
  its budget) leaves the batch at once, its cache kept for its next turn. Each step draws the uniforms of
  every row of the whole step and a row takes its place's, as :func:`~grpo_engine.sampling.decode.decode`
  does with ``draw_rows``.
- The stop texts are tested by :class:`StopCheck`, only for rows whose newest token could end one.

Needs a cache of plain full-attention ``DynamicLayer`` s (sliding-window and other layers are refused, with
the fix: the re-prefill path).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from grpo_engine.ops.attention import is_decoder_lm, kv_cache
from grpo_engine.sampling.draw import BAD_DISTRIBUTION, TokenDraw, draw_uniforms, seeded_rng
from grpo_engine.sampling.turns import Turn

__all__ = ["CachedTurns", "StopCheck", "keeps_cache"]


def keeps_cache(model: nn.Module) -> str | None:
    """None when :class:`CachedTurns` can keep ``model``'s KV cache across turns (a transformers causal LM
    whose every layer is full attention, under sdpa or eager attention: a padding mask with holes), else
    why not (one phrase).

    Example:
        >>> keeps_cache(nn.Linear(1, 1))
        'not a transformers causal LM'
    """
    if not is_decoder_lm(model):
        return "not a transformers causal LM"
    from transformers.cache_utils import get_layer_types_and_kwargs

    try:
        kinds = set(get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))[0])
    except Exception as error:  # a config transformers cannot read layer types from
        return f"its layer types are unknown ({type(error).__name__})"
    if kinds != {"full_attention"}:
        return f"layers of types {sorted(kinds)} (needs full attention only)"
    implementation = getattr(model.config, "_attn_implementation", None) or "eager"
    if implementation not in ("sdpa", "eager"):
        return f"attention implementation {implementation!r} (needs 'sdpa' or 'eager')"
    return None


class StopCheck:
    """Which rows' turns so far hold one of ``texts`` (the turn's last ``len(text) + 2`` tokens decoded with
    their special tokens, as a text of n characters takes at most n tokens), or, with no text, for which
    ``closed(turn text)`` is true. A row is decoded only when its newest token's own text holds the last
    character of a stop text (the token that completes one does): the same stops as decoding every row.

    Args:
        tokenizer: decodes the ids.
        texts: the stop texts (empty ones are ignored).
        closed: a test of the whole turn's text, used when ``texts`` is empty (a parser's ``call_closed``).

    Example:
        >>> # StopCheck(tokenizer, ["</tool_call>"])(ids)  # ids [r, t] -> [r] bool
    """

    def __init__(self, tokenizer, texts: Sequence[str] = (),
                 closed: Callable[[str], bool] | None = None) -> None:
        self.tokenizer, self.texts = tokenizer, tuple(t for t in texts if t)
        self.closed = None if self.texts else closed
        self.window = max(len(t) for t in self.texts) + 2 if self.texts else 0
        self.last_chars = {t[-1] for t in self.texts}
        self.could_end: dict[int, bool] = {}  # each token id seen: does its text hold a last character?

    @property
    def active(self) -> bool:
        """Whether anything can stop a turn."""
        return bool(self.texts) or self.closed is not None

    def _could_end(self, token: int) -> bool:
        if token not in self.could_end:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            self.could_end[token] = any(c in text for c in self.last_chars)
        return self.could_end[token]

    def __call__(self, ids: Tensor) -> Tensor:
        """[r] bool: whether each row's turn so far, ``ids`` [r, t], holds a stop."""
        hit = torch.zeros(ids.shape[0], dtype=torch.bool)
        if self.closed is not None:
            turns = self.tokenizer.batch_decode(ids.tolist(), skip_special_tokens=False)
            return torch.tensor([self.closed(turn) for turn in turns], dtype=torch.bool)
        maybe = [k for k, token in enumerate(ids[:, -1].tolist()) if self._could_end(token)]
        if maybe:
            turns = self.tokenizer.batch_decode(ids[maybe, -self.window:].tolist(), skip_special_tokens=False)
            hit[maybe] = torch.tensor([any(t in turn for t in self.texts) for turn in turns])
        return hit


@dataclasses.dataclass
class _Held:
    """One row's cache between turns: the keys and values of ``seen[:held]`` per layer ([1, H, held, D]),
    and every id the row had at the end of its last turn (its context and what it sampled)."""

    seen: list[int]
    held: int
    layers: list[tuple[Tensor, Tensor]]


class CachedTurns:
    """Continues several rows by one model turn each on our decoding loop, keeping each row's KV cache from
    one call to the next (the module docstring); a :class:`~grpo_engine.sampling.turns.TurnGenerator`.

    Args:
        model: a transformers causal LM whose KV cache is a ``DynamicCache`` of full-attention layers.
        tokenizer: decodes turns for the stop texts.
        eos_ids: the ids that end a turn (kept in it).
        pad_id: the id of the padding (masked, never attended to).
        token_draw: the token draw at a temperature (``HFSampler.token_draw``).

    Attributes:
        prefilled: context tokens fed since the last :meth:`reset` that the rows had not sampled themselves
            (the prompt, the environment's tokens, and a whole context that did not extend a row's cache).

    Example:
        >>> # turns = CachedTurns(model, tokenizer, eos_ids=[2], pad_id=0, token_draw=sampler.token_draw)
        >>> # first = turns.generate_turn([prompt], max_new_tokens=[64], places=[0], temperature=1.0,
        >>> #                             seed=0, stop_texts=["</tool_call>"])
        >>> # then = turns.generate_turn([prompt + list(first[0].ids) + reply], ...)  # prefills the reply
        >>> # turns.reset()
    """

    def __init__(self, model: nn.Module, tokenizer, *, eos_ids: Sequence[int], pad_id: int,
                 token_draw: Callable[[float], TokenDraw]) -> None:
        self.model, self.tokenizer, self.eos_ids, self.pad_id = model, tokenizer, list(eos_ids), pad_id
        self.token_draw = token_draw
        self.rows: dict[int, _Held] = {}
        self.prefilled = 0
        self._keyword = "past_key_values"  # the keyword the model takes its cache under, once seen

    def reset(self) -> None:
        """Frees every row's cache and zeroes :attr:`prefilled`."""
        self.rows.clear()
        self.prefilled = 0

    @torch.no_grad()
    def generate_turn(self, contexts: Sequence[Sequence[int]], *, max_new_tokens: Sequence[int],
                      places: Sequence[int], temperature: float, seed: int, stop_texts: Sequence[str],
                      total_rows: int | None = None, closed: Callable[[str], bool] | None = None
                      ) -> list[Turn]:
        """One turn per context (:meth:`~grpo_engine.sampling.turns.TurnGenerator.generate_turn`).

        Args:
            contexts, max_new_tokens, places, temperature, seed, stop_texts: as the protocol's.
            total_rows: the rows of the whole step whose uniforms each token's draw takes (default one past
                the highest place): the re-prefill path's, for the same tokens.
            closed: a test of the turn's text that ends it, when ``stop_texts`` is empty.

        Returns:
            One :class:`~grpo_engine.sampling.turns.Turn` per context, in order.

        Raises:
            ValueError: contexts, budgets and places that do not pair up, an empty context, a budget under
                1, a repeated place, a cache this path cannot keep, or logits that are not a distribution.
        """
        n = len(contexts)
        if not n == len(max_new_tokens) == len(places):
            raise ValueError(f"generate_turn: {n} contexts, {len(max_new_tokens)} budgets and {len(places)} "
                             "places; pass one of each per row")
        if len(set(places)) != n or min((len(c) for c in contexts), default=1) < 1 or min(
                max_new_tokens, default=1) < 1:
            raise ValueError(f"generate_turn: places {list(places)} must be distinct, every context "
                             f"non-empty and every budget >= 1 (budgets {list(max_new_tokens)})")
        if not n:
            return []
        total = max(places) + 1 if total_rows is None else total_rows
        self.rows = {p: h for p, h in self.rows.items() if p in set(places)}  # the absent ones finished
        held = [self._held(list(c), p) for c, p in zip(contexts, places)]
        check = StopCheck(self.tokenizer, stop_texts, closed)
        device = next(self.model.parameters()).device
        with seeded_rng(seed, device):
            ids, logprobs, ended, kept = self._decode(contexts, held, max_new_tokens, places, total,
                                                      self.token_draw(temperature), check, device)
        turns = []
        for k, (context, place) in enumerate(zip(contexts, places)):
            self.rows[place] = _Held(list(context) + ids[k], len(context) + len(ids[k]) - 1, kept[k])
            turns.append(Turn(tuple(ids[k]), tuple(logprobs[k]), ended[k]))
        return turns

    def _held(self, context: list[int], place: int) -> _Held:
        """What the row at ``place`` holds for ``context`` (nothing when it does not extend the row's last
        turn); counts the tokens it must prefill."""
        row = self.rows.get(place)
        if row is None or context[:len(row.seen)] != row.seen or len(context) <= row.held:
            self.prefilled += len(context)
            return _Held([], 0, [])
        self.prefilled += len(context) - len(row.seen)
        return row

    def _prefill(self, contexts: Sequence[Sequence[int]], held: list[_Held], device: torch.device
                 ) -> tuple[object, Tensor, Tensor]:
        """The forward over each row's new tokens after its cache: (the model's output, which cache columns
        are the rows' tokens [n, S], each row's next position [n])."""
        n, width = len(held), max(h.held for h in held)
        news = [list(c)[h.held:] for c, h in zip(contexts, held)]
        length = max(len(t) for t in news)
        ids = torch.full((n, length), self.pad_id, dtype=torch.long)
        valid = torch.zeros((n, width + length), dtype=torch.bool)
        for k, (h, new) in enumerate(zip(held, news)):
            ids[k, length - len(new):] = torch.tensor(new)
            valid[k, width - h.held:width] = True
            valid[k, width + length - len(new):] = True
        start = torch.tensor([h.held for h in held])
        position = start[:, None] + (valid[:, width:].long().cumsum(-1) - 1).clamp(min=0)
        cache = {}
        if width:
            from transformers import DynamicCache

            cache = {self._keyword: DynamicCache(ddp_cache_data=self._aligned(held, width, device))}
        out = self.model(input_ids=ids.to(device), attention_mask=valid.long().to(device),
                         position_ids=position.to(device), use_cache=True, logits_to_keep=1, **cache)
        return out, valid.to(device), (start + torch.tensor([len(t) for t in news])).to(device)

    @staticmethod
    def _aligned(held: list[_Held], width: int, device: torch.device) -> list[tuple[Tensor, Tensor]]:
        """Every layer's keys and values of the rows' caches, right-aligned in ``width`` columns (zeros before
        a shorter row's)."""
        some = next(h.layers for h in held if h.held)
        out = []
        for layer, (key, value) in enumerate(some):
            keys = key.new_zeros((len(held), key.shape[1], width, key.shape[3]))
            values = value.new_zeros((len(held), value.shape[1], width, value.shape[3]))
            for k, h in enumerate(held):
                if h.held:
                    keys[k, :, width - h.held:] = h.layers[layer][0][0]
                    values[k, :, width - h.held:] = h.layers[layer][1][0]
            out.append((keys.to(device), values.to(device)))
        return out

    def _cache_of(self, out) -> object:
        from transformers.cache_utils import DynamicCache, DynamicLayer

        name, cache = kv_cache(out)
        kinds = sorted({type(layer).__name__ for layer in getattr(cache, "layers", [])})
        if not isinstance(cache, DynamicCache) or {type(layer) for layer in cache.layers} != {DynamicLayer}:
            raise ValueError(f"{type(self.model).__name__} keeps a {type(cache).__name__} cache (layers "
                             f"{kinds}); keeping it across turns needs a DynamicCache of full-attention "
                             "DynamicLayers: use the re-prefill path, ToolSampler(..., kv_cache=False)")
        self._keyword = name
        return cache

    def _decode(self, contexts: Sequence[Sequence[int]], held: list[_Held], budgets: Sequence[int],
                places: Sequence[int], total: int, draw: TokenDraw, check: StopCheck, device: torch.device
                ) -> tuple[list[list[int]], list[list[float]], list[str], list[list[tuple[Tensor, Tensor]]]]:
        """The turn's tokens, log-probs and end of each row, and each row's cache after it."""
        n, steps = len(held), max(budgets)
        out, valid, position = self._prefill(contexts, held, device)
        turn, turn_logprobs = torch.full((n, steps), self.pad_id), torch.zeros((n, steps), dtype=torch.double)
        lengths, ended, kept = [0] * n, [""] * n, [[] for _ in range(n)]
        rows = torch.arange(n)  # the output row of each row still in its turn
        place, budget = torch.tensor(list(places), device=device), torch.tensor(list(budgets))
        eos = torch.tensor(self.eos_ids, device=device)
        for t in range(steps):
            cache = self._cache_of(out)
            u = draw_uniforms(total, device)[place[rows.to(device)]] if draw.needs_uniforms else None
            token, logprob, ok = draw(out.logits[:, -1], u)
            if not ok.all():
                raise ValueError(BAD_DISTRIBUTION)
            turn[rows, t] = token.cpu()
            if logprob is not None:
                turn_logprobs[rows, t] = logprob.double().cpu()
            stops = check(turn[rows, :t + 1]) if check.active else torch.zeros(len(rows), dtype=torch.bool)
            eos_now = torch.isin(token, eos).cpu()
            done = eos_now | stops | (budget[rows] == t + 1)
            for k in done.nonzero().flatten().tolist():  # each row whose turn ended keeps its cache
                r = int(rows[k])
                lengths[r], ended[r] = t + 1, "eos" if eos_now[k] else "stop" if stops[k] else "length"
                kept[r] = [(key[k:k + 1, :, valid[k]].clone(), value[k:k + 1, :, valid[k]].clone())
                           for key, value, *_ in cache]
            if done.all():
                break
            if done.any():
                keep = (~done).nonzero().squeeze(1)
                cache.batch_select_indices(keep.to(device))
                rows, keep = rows[keep], keep.to(device)
                valid, position, token = valid[keep], position[keep], token[keep]
            valid = torch.cat([valid, valid.new_ones(len(rows), 1)], dim=1)
            out = self.model(input_ids=token[:, None], attention_mask=valid.long(),
                             position_ids=position[:, None], use_cache=True, logits_to_keep=1,
                             **{self._keyword: cache})
            position = position + 1
        ids = [turn[r, :lengths[r]].tolist() for r in range(n)]
        return ids, [turn_logprobs[r, :lengths[r]].tolist() for r in range(n)], ended, kept
