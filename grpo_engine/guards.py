"""Guards against non-finite numbers: what a step checks before it may change the weights.

A step is skipped, its weights untouched, when the total reward or an advantage is not finite
(checked before any forward pass) or when the loss, a loss term or the gradient norm is not finite
(checked before ``optimizer.step``). The explanation names what was not finite: which reward of the
breakdown, which completions' advantages, which rows' log-probs, which loss terms. The trainer
counts skipped steps and stops after ``max_nonfinite_steps`` in a row (:class:`NonFiniteError`).
"""

from __future__ import annotations

import math

from torch import Tensor

from grpo_engine.types import RewardOutput

__all__ = ["NonFiniteStep", "NonFiniteError", "nonfinite_advantages", "nonfinite_update"]


class NonFiniteStep(Exception):
    """A step met a non-finite value; it is skipped (message: what and where)."""


class NonFiniteError(RuntimeError):
    """Too many steps in a row were skipped for non-finite values."""


def _rows(flags: Tensor, limit: int = 8) -> str:
    rows = flags.nonzero().flatten().tolist()
    return f"{rows[:limit]}{' ...' if len(rows) > limit else ''}"


def nonfinite_advantages(rewards: RewardOutput, advantages: Tensor) -> str | None:
    """Why a step's rewards [B, G] or advantages [B, G] are unusable, or None when all are finite."""
    if not rewards.total.isfinite().all():
        bad = ~rewards.total.isfinite().all(1)
        names = [name for name, scores in rewards.breakdown.items() if not scores.isfinite().all()]
        largest = {name: float(scores.abs().max()) for name, scores in rewards.breakdown.items()}
        return (f"the total reward is not finite in groups {_rows(bad)} (non-finite rewards: {names or 'none'}; "
                f"largest |score| per reward: {largest}; the weighted sum overflowed float32)")
    if not advantages.isfinite().all():
        bad = ~advantages.isfinite()
        top = float(rewards.total.abs().max())
        return (f"advantages are not finite for completions {_rows(bad.flatten())} (groups {_rows(bad.any(1))}); "
                f"the rewards reach |r| = {top:.3g}, beyond what the advantage's group statistics hold in float32: "
                "scale the rewards down")
    return None


def nonfinite_update(metrics: dict[str, float], bad_logprob_rows: list[tuple[Tensor, Tensor]]) -> str | None:
    """Why an update must not be applied (its loss, a loss term or the gradient norm is not finite),
    or None. ``bad_logprob_rows``: (rows [n], non-finite flags [n]) of each micro-batch's log-probs."""
    terms = [name for name, value in metrics.items() if not math.isfinite(value)]
    if not terms:
        return None
    rows = [int(r) for idx, flags in bad_logprob_rows for r in idx[flags.cpu()].tolist()]
    where = f"; the log-probs of rows {rows[:8]} are not finite (the model's logits)" if rows else ""
    return f"non-finite {', '.join(terms)}{where}"
