"""Checks of the training prompts when a trainer is built, so a bad record stops the run before its first
step, not when it is drawn hours in.

- Every target is checked by the rewards (``Reward.check``; ``MathAccuracy`` parses it): all bad
  records are reported at once, each with its file and line, in one :class:`DataError`.
- Duplicates (same content and target) are counted and named in a warning; they stay (a repeated
  question is sampled more often, which may be what you meant).
- Prompts longer than ``max_prompt_tokens`` follow ``overlong``: ``"truncate"`` (the sampler cuts
  the middle of the question, keeping the template's head, warns and counts ``prompts/truncated``),
  ``"drop"`` (removed here, with a warning) or ``"error"`` (a :class:`DataError` naming each one).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

from grpo_engine.data.errors import DataError, data_error
from grpo_engine.data.records import to_prompts
from grpo_engine.data.stream import PromptStream
from grpo_engine.protocols import PromptSource
from grpo_engine.types import Prompt

__all__ = ["Overlong", "check_prompts", "training_prompts"]

Overlong = Literal["truncate", "drop", "error"]


def check_prompts(
    prompts: Sequence[Prompt],
    check_targets: Callable[[Sequence[Prompt]], list[str]],
    *,
    prompt_length: Callable[[Prompt], int] | None = None,
    max_prompt_tokens: int | None = None,
    overlong: Overlong = "truncate",
) -> list[Prompt]:
    """The prompts to train on, after the checks above.

    Args:
        prompts: the training prompts.
        check_targets: returns one line per problem (``WeightedSum.check``).
        prompt_length: tokens of a rendered prompt (``HFSampler.prompt_tokens``); without it the
            length policy is left to the sampler.
        max_prompt_tokens: the limit ``overlong`` applies to.
        overlong: ``"truncate"``, ``"drop"`` or ``"error"``.

    Raises:
        DataError: a target a reward cannot score, or (``overlong="error"``) an over-long prompt.

    Example:
        >>> ok = check_prompts([Prompt("1+1?", target="2")], lambda ps: [])
        >>> len(ok)
        1
    """
    if overlong not in ("truncate", "drop", "error"):
        raise ValueError(f"overlong={overlong!r} must be 'truncate', 'drop' or 'error'")
    problems = check_targets(prompts)
    if problems:
        raise data_error(problems, "training prompts", "fix these records (or their reward) before training")
    _warn_duplicates(prompts)
    if overlong == "truncate" or prompt_length is None or max_prompt_tokens is None:
        return list(prompts)
    lengths = [prompt_length(p) for p in prompts]
    long = [(p, n) for p, n in zip(prompts, lengths) if n > max_prompt_tokens]
    if long and overlong == "error":
        raise data_error([f"{p.location}: {n} tokens > max_prompt_tokens={max_prompt_tokens}"
                          for p, n in long],
                         "training prompts", "overlong_prompts='error': raise max_prompt_tokens, or set "
                         "overlong_prompts='truncate' or 'drop'")
    kept = [p for p, n in zip(prompts, lengths) if n <= max_prompt_tokens]
    if long:
        if not kept:
            raise DataError(f"every training prompt is longer than max_prompt_tokens={max_prompt_tokens} "
                            f"(the shortest has {min(lengths)} tokens); raise max_prompt_tokens")
        warnings.warn(f"dropped {len(long)} of {len(prompts)} training prompts longer than max_prompt_tokens="
                      f"{max_prompt_tokens} (overlong_prompts='drop'; first: {long[0][0].location}, "
                      f"{long[0][1]} tokens)", stacklevel=3)
    return kept


def training_prompts(prompts: Any, check_targets: Callable[[Sequence[Prompt]], list[str]],
                     prompt_length: Callable[[Prompt], int], *, max_prompt_tokens: int, overlong: Overlong,
                     batch_size: int, seed: int) -> PromptSource:
    """The prompt source of a run, once every prompt passed :func:`check_prompts`.

    Args:
        prompts: ``Prompt`` records, dicts or a ``datasets.Dataset`` (served by a seeded
            :class:`PromptStream` of ``batch_size``), or a ``PromptSource`` (checked as it is).
        check_targets, prompt_length, max_prompt_tokens, overlong: as :func:`check_prompts`.

    Raises:
        DataError: a bad record (see :func:`check_prompts`).
        ValueError: ``overlong="drop"`` would drop prompts of a ``PromptSource``, which cannot lose any.
    """
    source = prompts if isinstance(prompts, PromptSource) else None
    given = list(source.prompts) if source is not None else to_prompts(prompts, name="prompts")
    kept = check_prompts(given, check_targets, prompt_length=prompt_length,
                         max_prompt_tokens=max_prompt_tokens, overlong=overlong)
    if source is None:
        return PromptStream(kept, batch_size, seed=seed)
    if len(kept) != len(given):
        raise ValueError(f"overlong_prompts='drop' would drop {len(given) - len(kept)} prompts of the "
                         f"{type(source).__name__} given, which cannot lose prompts once built; pass the "
                         "prompts as a list, or filter them before building it")
    return source


def _warn_duplicates(prompts: Sequence[Prompt]) -> None:
    first: dict[tuple[str, str | None], Prompt] = {}
    repeats: list[tuple[Prompt, Prompt]] = []
    for prompt in prompts:
        key = (repr(prompt.content), prompt.target)
        if key in first:
            repeats.append((first[key], prompt))
        else:
            first[key] = prompt
    if repeats:
        original, copy = repeats[0]
        warnings.warn(f"{len(repeats)} of {len(prompts)} training prompts repeat an earlier one (same "
                      f"question and target; first: {copy.location} repeats {original.location}); they are "
                      "kept and sampled as often as they appear: remove them from the data if that is not "
                      "what you meant", stacklevel=3)
