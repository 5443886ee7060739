"""What both vLLM samplers share to continue multi-turn rows (the ``TurnGenerator`` of ``sampling/turns.py``).

Each row's context reaches vLLM as its exact token ids (colocated: ``TokensPrompt``; served: a token-id
prompt on ``/v1/completions``), one request per row (``n=1``), so that the engine's prefix cache serves
the part of the context an earlier turn already computed. A row's request:

- ``seed``: the turn's seed plus the row's place in the whole step (mod 2**31): its draws do not depend
  on which other rows run, nor on the rank that runs it.
- ``max_tokens``: the row's budget for the turn; ``stop_token_ids``: the EOS ids; ``stop``: the texts
  that close a tool call, kept in the output (``include_stop_str_in_output``), checked on the text with
  special tokens (as our own decoding loop checks it).
- ``logprobs=0``: each sampled token's log-prob at the sampling temperature (the engines run with
  processed log-probs, the trainer's quantity).

When a stop text is completed inside a token, vLLM keeps that whole token and drops only text: the ids
are those sampled, through the token that completed the stop text, each with its own log-prob. A turn
ends with ``"eos"`` when its last id is an EOS id, ``"stop"`` when vLLM matched a stop text, and
``"length"`` when the budget (or the engine's context length) ran out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grpo_engine.sampling.turns import Turn

__all__ = ["as_turn", "turn_requests"]


def turn_requests(contexts: Sequence[Sequence[int]], *, max_new_tokens: Sequence[int], places: Sequence[int],
                  temperature: float, seed: int, stop_texts: Sequence[str], top_p: float, top_k: int,
                  eos_ids: Sequence[int]) -> list[dict[str, Any]]:
    """One request's sampling settings per row, under the names both ``vllm.SamplingParams`` and the
    server's completions endpoint take (the prompt itself not included).

    Args:
        contexts: each row's whole context as token ids (see :class:`TurnGenerator`).
        max_new_tokens: each row's budget for the turn (>= 1).
        places: each row's place in the whole step.
        temperature, seed, stop_texts: as :meth:`TurnGenerator.generate_turn`.
        top_p, top_k: the sampler's (``top_k <= 0``: off).
        eos_ids: the ids that end a turn.

    Returns:
        One dict per row, in order.

    Raises:
        ValueError: lists of different lengths, an empty context, a budget below 1 or an empty stop text.

    Example:
        >>> turn_requests([[1, 2]], max_new_tokens=[5], places=[3], temperature=1.0, seed=10,
        ...               stop_texts=["</tool_call>"], top_p=1.0, top_k=0, eos_ids=[2])[0]["seed"]
        13
    """
    if not len(contexts) == len(max_new_tokens) == len(places):
        raise ValueError(f"generate_turn got {len(contexts)} contexts, {len(max_new_tokens)} max_new_tokens "
                         f"and {len(places)} places; pass one of each per row")
    for k, (context, budget) in enumerate(zip(contexts, max_new_tokens)):
        if not context:
            raise ValueError(f"generate_turn: row {k}'s context is empty; a row starts from its prompt's ids")
        if budget < 1:
            raise ValueError(f"generate_turn: row {k}'s max_new_tokens={budget!r} must be >= 1; leave a row "
                             "without room for a token out of the turn")
    if any(not text for text in stop_texts):
        raise ValueError(f"generate_turn: stop_texts={list(stop_texts)!r} holds an empty text, which every "
                         "turn contains; pass the text that closes a tool call, or none")
    return [{"n": 1, "temperature": temperature, "top_p": top_p, "top_k": top_k if top_k > 0 else -1,
             "max_tokens": int(budget), "logprobs": 0, "seed": (seed + place) % 2**31,
             "stop": list(stop_texts), "include_stop_str_in_output": True, "stop_token_ids": list(eos_ids),
             "skip_special_tokens": False}
            for budget, place in zip(max_new_tokens, places)]


def as_turn(ids: Sequence[int], logprobs: Sequence[float], *, finish_reason: str | None, stop_reason: Any,
            eos_ids: Sequence[int]) -> Turn:
    """One row's answer from vLLM as a :class:`Turn`.

    Args:
        ids: the token ids vLLM returned, as sampled.
        logprobs: each one's log-prob.
        finish_reason: vLLM's (``"stop"`` or ``"length"``).
        stop_reason: vLLM's: the stop text it matched (a ``str``), the stop id, or ``None``.
        eos_ids: the ids that end a turn.

    Returns:
        The turn: ``"eos"`` when its last id is an EOS id, else ``"stop"`` when vLLM matched a stop text,
        else ``"length"``.

    Raises:
        RuntimeError: ids and log-probs of different lengths, or a turn vLLM ended for another reason.

    Example:
        >>> as_turn([5, 2], [-0.5, -0.1], finish_reason="stop", stop_reason=None, eos_ids=[2]).ended
        'eos'
    """
    if len(ids) != len(logprobs):
        raise RuntimeError(f"vLLM returned {len(ids)} token ids with {len(logprobs)} log-probs; it must "
                           "return one per sampled token (request logprobs=0)")
    if ids and ids[-1] in eos_ids:
        ended = "eos"
    elif isinstance(stop_reason, str):
        ended = "stop"
    elif finish_reason == "length":
        ended = "length"
    else:
        raise RuntimeError(f"vLLM ended a turn with finish_reason={finish_reason!r}, stop_reason="
                           f"{stop_reason!r}, which is neither an EOS id {list(eos_ids)}, a stop text nor "
                           "the budget; the engine's EOS must be among the sampler's eos_ids")
    return Turn(tuple(int(i) for i in ids), tuple(float(x) for x in logprobs), ended)
