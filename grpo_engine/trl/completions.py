"""TRL's ``log_completions``: every ``logging_steps`` steps, the step's completions with their prompts and
rewards are appended to ``output_dir/completions.jsonl`` (one line a completion: ``step``, ``prompt``,
``completion``, ``reward`` and each reward function's score), and the first ``num_completions_to_print`` of
them (all when None) are logged. TRL prints them as a table (and logs one to W&B or trackio); the rows are
the same. Rank 0 writes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from torch import Tensor

from grpo_engine.callbacks import Callback, TrainerControl, TrainerState
from grpo_engine.types import RewardOutput, RolloutBatch

__all__ = ["CompletionLog"]

logger = logging.getLogger(__name__)


class CompletionLog(Callback):
    """Writes a step's completions every ``every_steps`` steps (module docstring).

    Args:
        every_steps: >= 1 (the run's logging period).
        output_dir: the folder of ``completions.jsonl``.
        to_print: how many rows to log (None: all).
    """

    def __init__(self, every_steps: int, output_dir: str | Path, to_print: int | None = None) -> None:
        self.every_steps, self.to_print = every_steps, to_print
        self.path = Path(output_dir) / "completions.jsonl"

    def on_rollout(self, trainer: Any, state: TrainerState, control: TrainerControl, *,
                   batch: RolloutBatch, rewards: RewardOutput, uncertainty: Tensor | None) -> None:
        step = state.step + 1  # the step being made
        if step % self.every_steps or not state.is_world_process_zero:
            return
        rows = completion_rows(step, batch, rewards)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as out:
            out.writelines(json.dumps(row) + "\n" for row in rows)
        for row in rows[:self.to_print]:
            logger.info("step %d | reward %.4g | prompt %r | completion %r", step, row["reward"],
                        row["prompt"], row["completion"])


def completion_rows(step: int, batch: RolloutBatch, rewards: RewardOutput) -> list[dict[str, Any]]:
    """One record a completion: its step, prompt (text or messages), text, total reward and each reward's."""
    total = rewards.total.reshape(-1).tolist()
    scores = {name: values.reshape(-1).tolist() for name, values in rewards.breakdown.items()}
    return [{"step": step, "prompt": batch.prompts[n // batch.group_size].content, "completion": text,
             "reward": total[n], **{name: values[n] for name, values in scores.items()}}
            for n, text in enumerate(batch.texts)]
