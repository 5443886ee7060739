"""Callbacks: code that runs at fixed points of training, with the trainer's state in and a control
record out.

Events, in order: ``on_init`` (once, when the trainer is built: check the setup), ``on_train_start``,
then at every step ``on_rollout`` (the batch just sampled and scored, every group drawn, with the
per-group uncertainty) and ``on_step_end`` (the step's metrics, which a callback may add to), then
``on_save`` (a checkpoint was written) and ``on_train_end``. ``step()`` itself runs ``on_rollout`` and
``on_step_end``, so a loop over ``step()`` runs them too. A callback asks through ``TrainerControl``:
``should_stop`` (``train()`` ends after this step and saves as usual), ``should_save`` (``train()``
writes a checkpoint after this step), ``should_evaluate`` (:class:`HeldOutEval` evaluates now).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from torch import Tensor

from grpo_engine.types import Prompt, RewardOutput, RolloutBatch

GRPOTrainer = Any  # the trainer calling the event (grpo_engine.trainer imports this module, not the reverse)

__all__ = ["Callback", "CallbackList", "TrainerState", "TrainerControl", "HeldOutEval"]


@dataclass
class TrainerState:
    """Where training stands: every counter of a run (read it; the trainer writes it).

    Attributes:
        step: optimizer steps done (the step just finished, in ``on_step_end``).
        train_seconds: seconds spent in steps so far (the clock of ``max_train_seconds``).
        temperature: the sampling temperature in force (``trainer.set_temperature`` changes it).
        skipped_steps: steps skipped for non-finite rewards, advantages, loss or gradients.
        skipped_in_a_row: of those, how many in a row up to now (the run stops at
            ``max_nonfinite_steps``).
        zero_std_warned: the warning that every group tied (no step changes the policy) was given.
        planned_steps: the run's step count once a calibrated time budget fixed it (``GRPOConfig.
            time_budget="calibrated"``), else None.
        update_steps: steps that updated the policy (some row had a gradient to compute: not every
            group tied, or the loss trains on zero-advantage rows too).
        update_seconds: those steps' seconds in loss, backward and optimizer step (``time/train_s``).
        plan_mark: ``(step, train_seconds, update_steps, update_seconds)`` when a calibrated budget
            made its first plan (a ``replan_step`` plans again from the steps since), else None.
        loss_metric_keys: the names of the loss's metrics seen so far (a step that trains no row logs
            them as 0).
        max_steps: the run's step limit (``GRPOConfig.max_steps``; a time budget may end the run sooner,
            ``planned_steps``). Not saved, like the two below.
        process_index, num_processes: this process's rank and the number of ranks (under
            ``torchrun``; 0 and 1 otherwise). Not saved: they describe the launch. Callbacks run on
            every rank and see the whole step's batch and metrics; one that writes or evaluates
            checks ``is_world_process_zero``.
    """

    step: int = 0
    train_seconds: float = 0.0
    temperature: float = 1.0
    skipped_steps: int = 0
    skipped_in_a_row: int = 0
    zero_std_warned: bool = False
    planned_steps: int | None = None
    update_steps: int = 0
    update_seconds: float = 0.0
    plan_mark: tuple[int, float, int, float] | None = None
    loss_metric_keys: tuple[str, ...] = ("loss",)
    max_steps: int | None = None
    process_index: int = 0
    num_processes: int = 1

    @property
    def global_step(self) -> int:
        """``step``, by the name ``transformers.TrainerState`` gives it (TRL's reward functions read it)."""
        return self.step

    @property
    def is_world_process_zero(self) -> bool:
        """Whether this is rank 0, the process that logs, evaluates and writes."""
        return self.process_index == 0

    def state_dict(self) -> dict[str, Any]:
        """The counters a checkpoint keeps (not the launch's ``max_steps``, ``process_index``,
        ``num_processes``)."""
        saved = asdict(self)
        del saved["max_steps"], saved["process_index"], saved["num_processes"]
        return saved

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from :meth:`state_dict`'s output."""
        for name, value in state.items():
            listed = name in ("loss_metric_keys", "plan_mark") and value is not None
            setattr(self, name, tuple(value) if listed else value)


@dataclass
class TrainerControl:
    """What callbacks ask of the training loop; ``should_save`` and ``should_evaluate`` are reset
    after each step, ``should_stop`` holds."""

    should_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False


class Callback:
    """Base class: override the events you need; each does nothing by default.

    Example:
        >>> class StopAtReward(Callback):
        ...     def on_step_end(self, trainer, state, control, *, metrics):
        ...         control.should_stop = metrics["reward/mean"] > 0.9
    """

    def on_init(self, trainer: GRPOTrainer, state: TrainerState, control: TrainerControl) -> None:
        """The trainer is built (raise here to refuse a setup the callback cannot work with)."""

    def on_train_start(self, trainer: GRPOTrainer, state: TrainerState, control: TrainerControl) -> None:
        """``train()`` begins."""

    def on_rollout(self, trainer: GRPOTrainer, state: TrainerState, control: TrainerControl, *,
                   batch: RolloutBatch, rewards: RewardOutput, uncertainty: Tensor | None) -> None:
        """A step's batch is sampled and scored: every group drawn (``batch.trained_groups`` marks
        those trained on), rewards [B, G], uncertainty [B] or None."""

    def on_step_end(self, trainer: GRPOTrainer, state: TrainerState, control: TrainerControl, *,
                    metrics: dict[str, Any]) -> None:
        """A step is done; ``metrics`` is the dict that will be logged (add to it)."""

    def on_save(self, trainer: GRPOTrainer, state: TrainerState, control: TrainerControl, *,
                path: Any) -> None:
        """A checkpoint (or the final model) was written to ``path``."""

    def on_train_end(self, trainer: GRPOTrainer, state: TrainerState, control: TrainerControl) -> None:
        """``train()`` ends."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this callback (a stateful one overrides this and the next)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output when a run resumes."""


class CallbackList:
    """A run's callbacks, each event called on every one in order, with the trainer, its state and its
    control (the user's callbacks first, then the logging backends, so these see every metric)."""

    def __init__(self, callbacks: Sequence[Callback], trainer: GRPOTrainer, state: TrainerState,
                 control: TrainerControl) -> None:
        self.callbacks, self.trainer, self.state, self.control = list(callbacks), trainer, state, control

    def on_init(self) -> None:
        for callback in self.callbacks:
            callback.on_init(self.trainer, self.state, self.control)

    def on_train_start(self) -> None:
        for callback in self.callbacks:
            callback.on_train_start(self.trainer, self.state, self.control)

    def on_rollout(self, *, batch: RolloutBatch, rewards: RewardOutput, uncertainty: Tensor | None) -> None:
        for callback in self.callbacks:
            callback.on_rollout(self.trainer, self.state, self.control, batch=batch, rewards=rewards,
                                uncertainty=uncertainty)

    def on_step_end(self, *, metrics: dict[str, Any]) -> None:
        for callback in self.callbacks:
            callback.on_step_end(self.trainer, self.state, self.control, metrics=metrics)

    def on_save(self, *, path: Any) -> None:
        for callback in self.callbacks:
            callback.on_save(self.trainer, self.state, self.control, path=path)

    def on_train_end(self) -> None:
        for callback in self.callbacks:
            callback.on_train_end(self.trainer, self.state, self.control)


class HeldOutEval(Callback):
    """Greedy pass@1 on held-out prompts every ``every_steps`` steps (or when a callback sets
    ``control.should_evaluate``), added to that step's metrics as ``eval/pass@1`` (and
    ``time/eval_s``); with ``k`` > 1 also ``eval/avg@k``, ``eval/pass@k`` and ``eval/maj@k``. A trainer
    with tools evaluates multi-turn rollouts with its own ToolSampler (its budgets; the reward may read the
    episode and the environment) and adds ``eval/turns/greedy`` and ``eval/tool_calls/greedy`` (and their
    ``sampled`` twins). Its time is not counted in ``train_seconds``. Under data parallel rank 0 evaluates.

    Args:
        prompts: the held-out prompts.
        every_steps: >= 1.
        reward: decides correctness (default: the trainer's first reward).
        max_new_tokens: generation limit (default: the config's ``max_completion_tokens``; with tools the
            trainer's ToolSampler's budget applies).
        k: samples per prompt besides the greedy completion (1: greedy only).
        temperature: the samples' temperature (default: the config's ``temperature``).

    Raises:
        ValueError: ``every_steps`` or ``k`` is not an int >= 1, or no prompts.

    Example:
        >>> # GRPOTrainer(..., callbacks=[HeldOutEval(test_prompts, every_steps=20, k=4)])
    """

    def __init__(self, prompts: Sequence[Prompt], every_steps: int, *, reward: Any = None,
                 max_new_tokens: int | None = None, k: int = 1, temperature: float | None = None) -> None:
        if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1:
            raise ValueError(f"every_steps={every_steps!r} must be an int >= 1; e.g. HeldOutEval(prompts, "
                             "every_steps=20)")
        if not prompts:
            raise ValueError("HeldOutEval got no prompts; pass the held-out Prompt list")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"HeldOutEval: k={k!r} must be an int >= 1 (samples per prompt; 1: greedy only)")
        self.prompts, self.every_steps = list(prompts), every_steps
        self.reward, self.max_new_tokens, self.k, self.temperature = reward, max_new_tokens, k, temperature

    def on_step_end(self, trainer: GRPOTrainer, state: TrainerState, control: TrainerControl, *,
                    metrics: dict[str, Any]) -> None:
        if (state.step % self.every_steps and not control.should_evaluate) or not state.is_world_process_zero:
            return  # rank 0 evaluates; the trainer hands its metrics to the other ranks
        start = time.perf_counter()
        temperature = trainer.config.temperature if self.temperature is None else self.temperature
        sampled = {} if self.k == 1 else {"k": self.k, "temperature": temperature}
        metrics.update(trainer.evaluate(self.prompts, reward=self.reward, max_new_tokens=self.max_new_tokens,
                                        **sampled))
        metrics["time/eval_s"] = time.perf_counter() - start
        control.should_evaluate = False
