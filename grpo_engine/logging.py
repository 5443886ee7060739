"""Console progress and a JSONL metrics file per run.

Every logged line of ``metrics.jsonl`` is one JSON object with the step number and plain floats,
flushed as it is written, so a crashed run keeps every step it finished.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from grpo_engine.ops.groups import zero_std_fraction
from grpo_engine.types import RewardOutput, Rollout, RolloutBatch

__all__ = ["MetricsLogger", "StageTimer", "rollout_metrics", "step_metrics"]

_BAR_KEYS = (("reward", "reward/mean"), ("len", "completion_length/mean"), ("s/step", "time/step_s"))


class MetricsLogger:
    """Writes step metrics to ``<output_dir>/metrics.jsonl`` and drives a tqdm progress bar.

    Args:
        output_dir: the run folder (created if missing).
        total_steps: steps planned, for the progress bar (None when unknown).
        progress_bar: show the bar (off in tests and non-interactive logs).

    Example:
        >>> # with MetricsLogger("runs/x", total_steps=10) as log: log.log(1, {"reward/mean": 0.5})
    """

    def __init__(self, output_dir: str | Path, *, total_steps: int | None, progress_bar: bool = True,
                 initial_step: int = 0) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        self._bar = None
        if progress_bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=initial_step, desc="grpo", unit="step",
                             dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, Any], *, write: bool = True) -> None:
        """Records the metrics of ``step`` (the JSONL line only when ``write``)."""
        if write:
            record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._bar is not None:
            shown = {label: f"{metrics[key]:.3g}" for label, key in _BAR_KEYS if key in metrics}
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        """Closes the file and the bar."""
        if self._bar is not None:
            self._bar.close()
        self._file.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class NullLogger:
    """:class:`MetricsLogger`'s stand-in on the ranks other than 0 (data parallel): records nothing."""

    def __enter__(self) -> NullLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def log(self, step: int, metrics: dict[str, Any], *, write: bool = True) -> None:
        """Does nothing: rank 0 logs the step."""


class StageTimer:
    """Wall-clock seconds per stage of a step: ``with timer("sample"): ...``; ``seconds()`` gives
    ``time/<stage>_s`` for every stage and ``time/step_s`` since the timer was made."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - start

    def seconds(self) -> dict[str, float]:
        out = {f"time/{k}_s": v for k, v in self._seconds.items()}
        out["time/step_s"] = time.perf_counter() - self._start
        return out


def rollout_metrics(batch: RolloutBatch, rewards: RewardOutput) -> dict[str, float]:
    """The logged numbers of a step's batch: reward mean / std (total and per reward), completion
    lengths and generated tokens (the model's tokens: with tools, not the environment's), the truncated
    and zero-std fractions."""
    lengths = batch.completion_lengths.float()
    total = rewards.total.float()
    metrics = {
        "reward/mean": total.mean().item(),
        "reward/std": total.std().item() if total.numel() > 1 else 0.0,
        "completion_length/mean": lengths.mean().item(),
        "completion_length/max": lengths.max().item(),
        "truncated_fraction": batch.is_truncated.float().mean().item(),
        "zero_std_fraction": zero_std_fraction(total).item(),
        "tokens/generated": lengths.sum().item(),
    }
    if batch.episodes is not None:  # multi-turn: the model's turns per rollout
        metrics["turns/mean"] = sum(e.turns for e in batch.episodes) / max(len(batch.episodes), 1)
    for name, scores in rewards.breakdown.items():
        scores = scores.float().flatten()
        applies = scores[~scores.isnan()]  # a plain reward function's None: the reward does not apply
        metrics[f"reward/{name}/mean"] = applies.mean().item() if applies.numel() else 0.0
        metrics[f"reward/{name}/std"] = applies.std().item() if applies.numel() > 1 else 0.0
        if applies.numel() < scores.numel():
            metrics[f"reward/{name}/none"] = float(scores.numel() - applies.numel())
    # samples scored 0 because their reward failed (on_reward_error)
    for name, count in rewards.errors.items():
        metrics[f"reward/{name}/errors"] = float(count)
    metrics.update(rewards.metrics)  # counts the rewards reported (CodeTests' failure kinds)
    return metrics


def step_metrics(whole: Rollout, state: Any, *, loss: dict[str, float], seconds: dict[str, float],
                 temperature: float, lr: float) -> dict[str, float]:
    """What a step logs: its rollout's numbers (:func:`rollout_metrics` of the groups trained, every
    rank's), the sampler's and a group filter's counts, the loss metrics, the stage times, the
    temperature and learning rate it ran at, and the skipped steps so far. The first step whose groups
    all tie warns that it has no learning signal (``state.zero_std_warned``)."""
    metrics = {**rollout_metrics(whole.batch, whole.rewards), **whole.batch.metrics, **loss, **seconds,
               "temperature": temperature, "lr": lr, "skipped_steps": float(state.skipped_steps)}
    if whole.uncertainty is not None:
        metrics["entropy/semantic_mean"] = whole.uncertainty.float().mean().item()
    metrics["tokens/generated_per_s"] = metrics["tokens/generated"] / max(metrics["time/sample_s"], 1e-9)
    if metrics["zero_std_fraction"] == 1.0 and not state.zero_std_warned:
        state.zero_std_warned = True
        warnings.warn(f"step {state.step}: every group has identical rewards, so every advantage is 0 and "
                      "this step has no learning signal (its gradient is 0; only the optimizer's momentum "
                      "moves the weights). If this persists, make the task easier or the reward denser, or "
                      "raise group_size / temperature.", stacklevel=3)
    return metrics
