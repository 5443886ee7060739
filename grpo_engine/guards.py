"""Guards against non-finite numbers: what a step checks before it may change the weights.

A step is skipped, its weights untouched, when the total reward or an advantage is not finite
(checked before any forward pass) or when the loss, a loss term or the gradient norm is not finite
(checked before ``optimizer.step``). The explanation names what was not finite: which reward of the
breakdown, which completions' advantages, which rows' log-probs, which loss terms. Skipped steps
are counted in ``TrainerState`` (:func:`count_skipped`), and the run stops after
``max_nonfinite_steps`` in a row (:class:`NonFiniteError`). A save refuses non-finite weights.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn

from grpo_engine.types import RewardOutput
from grpo_engine.world import is_sharded

__all__ = ["NonFiniteError", "check_advantages", "nonfinite_advantages", "nonfinite_update", "count_skipped",
           "check_finite_weights"]


class NonFiniteError(RuntimeError):
    """Too many steps in a row were skipped for non-finite values."""


def _rows(flags: Tensor, limit: int = 8) -> str:
    rows = flags.nonzero().flatten().tolist()
    return f"{rows[:limit]}{' ...' if len(rows) > limit else ''}"


def check_advantages(advantages: Tensor, rewards: RewardOutput, owner: str) -> None:
    """ValueError naming ``owner`` unless ``advantages`` have the rewards' shape [B, G]."""
    if tuple(advantages.shape) != tuple(rewards.total.shape):
        raise ValueError(f"{owner} returned advantages of shape {tuple(advantages.shape)}; an AdvantageFn "
                         f"maps rewards [B, G]={tuple(rewards.total.shape)} to the same shape")


def nonfinite_advantages(rewards: RewardOutput, advantages: Tensor) -> str | None:
    """Why a step's rewards [B, G] or advantages [B, G] are unusable, or None when all are finite."""
    if not rewards.total.isfinite().all():
        bad = ~rewards.total.isfinite().all(1)
        names = [name for name, scores in rewards.breakdown.items() if not scores.isfinite().all()]
        largest = {name: float(scores.abs().max()) for name, scores in rewards.breakdown.items()}
        return (f"the total reward is not finite in groups {_rows(bad)} (non-finite rewards: "
                f"{names or 'none'}; largest |score| per reward: {largest}; the weighted sum overflowed "
                "float32)")
    if not advantages.isfinite().all():
        bad = ~advantages.isfinite()
        top = float(rewards.total.abs().max())
        return (f"advantages are not finite for completions {_rows(bad.flatten())} (groups "
                f"{_rows(bad.any(1))}); the rewards reach |r| = {top:.3g}, beyond what the advantage's group "
                "statistics hold in float32: scale the rewards down")
    return None


def nonfinite_update(metrics: dict[str, float], nonfinite_rows: Callable[[], Sequence[int]]) -> str | None:
    """Why an update must not be applied (its loss, a loss term or the gradient norm is not finite),
    or None. ``nonfinite_rows()``: the rows whose log-probs the training pass found not finite (asked
    only when something is)."""
    terms = [name for name, value in metrics.items() if not math.isfinite(value)]
    if not terms:
        return None
    rows = list(nonfinite_rows())
    where = f"; the log-probs of rows {rows[:8]} are not finite (the model's logits)" if rows else ""
    return f"non-finite {', '.join(terms)}{where}"


def count_skipped(state: Any, problem: str | None, max_in_a_row: int) -> None:
    """Counts in ``state`` (a ``TrainerState``) whether the step just taken was skipped for
    ``problem`` (None: it was applied), warning with the reason.

    Raises:
        NonFiniteError: ``max_in_a_row`` steps in a row were skipped.
    """
    if problem is None:
        state.skipped_in_a_row = 0
        return
    state.skipped_steps += 1
    state.skipped_in_a_row += 1
    warnings.warn(f"step {state.step + 1} skipped, weights unchanged: {problem}", stacklevel=3)
    if state.skipped_in_a_row >= max_in_a_row:
        raise NonFiniteError(
            f"{state.skipped_in_a_row} steps in a row were skipped for non-finite values (the last: "
            f"{problem}); the weights are those after step {state.step - state.skipped_in_a_row + 1} and "
            "nothing non-finite was saved: fix the reward or the settings named above, then resume from the "
            "last checkpoint")


def check_finite_weights(model: nn.Module, path: Any, world: Any) -> None:
    """Refuses (ValueError) to save ``path`` when a trained parameter holds NaN or inf on any rank of
    ``world`` (a collective: every rank calls it; under FSDP2 each checks its shards)."""
    bad = [name for name, p in model.named_parameters()
           if p.requires_grad and not bool((p.to_local() if is_sharded(p) else p).isfinite().all())]
    count = int(world.sum([len(bad)])[0])
    if count:
        first = f" (first: {bad[0]})" if bad else ""
        raise ValueError(f"refusing to save {path}: {count} trained tensors hold NaN or inf{first}; the last "
                         "complete checkpoint stays as it was")
