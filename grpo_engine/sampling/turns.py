"""One turn of several multi-turn rows: what a sampler that generates tool rollouts provides.

:class:`~grpo_engine.tools.rollout.ToolSampler` builds each row's context turn by turn (the prompt, the
model's turns, the environment's messages) as exact token ids. A sampler that can continue such contexts
itself, with its own engine, implements :class:`TurnGenerator`; the ToolSampler then generates every turn
through it (the vLLM samplers do, from the exact ids with ``TokensPrompt`` and prefix caching). A sampler
without it is run on our own decoding loop, which keeps each row's KV cache from one turn to the next.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

__all__ = ["Turn", "TurnGenerator"]


@dataclasses.dataclass(frozen=True)
class Turn:
    """What one row sampled in one turn.

    Attributes:
        ids: the sampled token ids, as sampled (the EOS included when the model sampled it; through the
            token that completed a stop text when one did).
        logprobs: each sampled token's log-prob at the sampling temperature (after the temperature,
            before top-k / top-p: the trainer's quantity), one per id.
        ended: ``"eos"`` (the model sampled an EOS id), ``"stop"`` (a stop text appeared: a tool call
            closed) or ``"length"`` (the row's token budget for the turn ran out).
    """

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    ended: Literal["eos", "stop", "length"]


@runtime_checkable
class TurnGenerator(Protocol):
    """Continues several rows by one model turn each."""

    def generate_turn(self, contexts: Sequence[Sequence[int]], *, max_new_tokens: Sequence[int],
                      places: Sequence[int], temperature: float, seed: int,
                      stop_texts: Sequence[str]) -> list[Turn]:
        """One turn per context.

        Args:
            contexts: each row's whole context so far, as token ids (its prompt, then its turns and the
                environment's messages); consecutive calls extend a row's previous context.
            max_new_tokens: each row's budget for this turn (>= 1).
            places: each row's place in the whole step (its draws are keyed by it, so K ranks sample
                what one process samples).
            temperature: the sampling temperature.
            seed: this turn's seed (the call's seed and the turn).
            stop_texts: texts that end a turn when the decoded turn contains one (a tool call closed);
                empty: EOS and the budget only.

        Returns:
            One :class:`Turn` per context, in order.
        """
        ...
