"""Logging backends as callbacks: every step's metrics to TensorBoard, Weights & Biases or trackio.

``metrics.jsonl`` is always written; these add a backend. ``GRPOConfig(report_to=["tensorboard"])``
appends the callbacks after the user's own, so they see every metric a callback adds (``eval/*``).
Each backend is an optional extra (``pip install grpo_engine[tensorboard]``, ``[wandb]``,
``[trackio]``), imported only when its callback starts. Metric names are ours (``reward/mean``,
``zero_std_fraction``...); docs/from_trl.md maps them to TRL's.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, ClassVar

from grpo_engine.callbacks import Callback, TrainerControl, TrainerState

__all__ = ["TensorBoardLogger", "WandbLogger", "TrackioLogger", "BACKENDS", "report_callbacks"]


def _require(module: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"report_to={extra!r} needs the {module} package: pip install "
                          f"'grpo_engine[{extra}]' (or pip install {module})") from exc


def _run_config(trainer: Any) -> dict[str, Any]:
    return {"config": trainer.config.model_dump(mode="json"),
            "memory": trainer.memory.model_dump(mode="json")}


class TensorBoardLogger(Callback):
    """Writes every step's metrics as TensorBoard scalars (``<output_dir>/tensorboard`` by default).

    Example:
        >>> # GRPOTrainer(..., callbacks=[TensorBoardLogger()]); tensorboard --logdir runs/grpo/tensorboard
    """

    def __init__(self, log_dir: str | Path | None = None) -> None:
        self.log_dir, self.writer = log_dir, None

    def on_train_start(self, trainer: Any, state: TrainerState, control: TrainerControl) -> None:
        _require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.log_dir or Path(trainer.config.output_dir) / "tensorboard"))

    def on_step_end(self, trainer: Any, state: TrainerState, control: TrainerControl, *,
                    metrics: dict[str, float]) -> None:
        if self.writer is None:  # a loop over step() without train(): start on the first step
            self.on_train_start(trainer, state, control)
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=state.step)
        self.writer.flush()

    def on_train_end(self, trainer: Any, state: TrainerState, control: TrainerControl) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class _RunLogger(Callback):
    """A tracker run opened at the start (or the first step), fed every step's metrics, closed at the end."""

    def __init__(self, project: str | None = None, **init_kwargs: Any) -> None:
        self.project, self.init_kwargs, self.run = project, init_kwargs, None

    def on_step_end(self, trainer: Any, state: TrainerState, control: TrainerControl, *,
                    metrics: dict[str, float]) -> None:
        if self.run is None:
            self.on_train_start(trainer, state, control)
        self._log(dict(metrics), state.step)

    def on_train_end(self, trainer: Any, state: TrainerState, control: TrainerControl) -> None:
        if self.run is not None:
            self._finish()
            self.run = None

    def _log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError


class WandbLogger(_RunLogger):
    """Logs every step's metrics to Weights & Biases (``WANDB_MODE=offline`` keeps the run on disk).

    W&B's environment variables hold over our defaults, as in TRL, and this logger's arguments over both:
    ``WANDB_PROJECT`` (else the project is "grpo_engine"), ``WANDB_DIR`` (else the run's ``output_dir``),
    ``WANDB_ENTITY``, ``WANDB_NAME``, ``WANDB_RUN_GROUP``, ``WANDB_JOB_TYPE``, ``WANDB_TAGS`` (comma
    separated), ``WANDB_NOTES`` and ``WANDB_MODE``, read when the run starts (wandb itself reads them once
    per process, at its first run).

    Args:
        project: the W&B project; extra keyword arguments go to ``wandb.init`` (``name``, ``tags``...).

    Example:
        >>> WandbLogger(name="first").init_arguments("runs/grpo", {})["project"]  # without WANDB_PROJECT
        'grpo_engine'
    """

    ENVIRONMENT: ClassVar[dict[str, str]] = {
        "project": "WANDB_PROJECT", "dir": "WANDB_DIR", "entity": "WANDB_ENTITY", "name": "WANDB_NAME",
        "group": "WANDB_RUN_GROUP", "job_type": "WANDB_JOB_TYPE", "tags": "WANDB_TAGS",
        "notes": "WANDB_NOTES", "mode": "WANDB_MODE"}  # wandb.init's argument -> its variable

    def on_train_start(self, trainer: Any, state: TrainerState, control: TrainerControl) -> None:
        wandb = _require("wandb", "wandb")
        self.run = wandb.init(**self.init_arguments(trainer.config.output_dir, _run_config(trainer)))

    def init_arguments(self, output_dir: str, config: dict[str, Any]) -> dict[str, Any]:
        """The arguments of ``wandb.init``: ours (``project``, ``dir``, ``config``), under the environment's
        (:attr:`ENVIRONMENT`), under this logger's own."""
        ours: dict[str, Any] = {"project": "grpo_engine", "dir": output_dir, "config": config}
        environment = {name: os.environ[variable] for name, variable in self.ENVIRONMENT.items()
                       if os.environ.get(variable)}
        if "tags" in environment:
            environment["tags"] = [tag.strip() for tag in environment["tags"].split(",") if tag.strip()]
        given = {"project": self.project} if self.project else {}
        return {**ours, **environment, **given, **self.init_kwargs}

    def _log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def _finish(self) -> None:
        self.run.finish()


class TrackioLogger(_RunLogger):
    """Logs every step's metrics to trackio (Hugging Face's local-first tracker; ``trackio show``)."""

    def on_train_start(self, trainer: Any, state: TrainerState, control: TrainerControl) -> None:
        self._trackio = _require("trackio", "trackio")
        ours = {"project": self.project or "grpo_engine", "config": _run_config(trainer)}
        self.run = self._trackio.init(**{**ours, **self.init_kwargs})

    def _log(self, metrics: dict[str, float], step: int) -> None:
        self._trackio.log(metrics, step=step)

    def _finish(self) -> None:
        self._trackio.finish()


BACKENDS = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger, "trackio": TrackioLogger}


def report_callbacks(names: list[str]) -> list[Callback]:
    """One logger callback per backend name of ``GRPOConfig.report_to``."""
    return [BACKENDS[name]() for name in names]
