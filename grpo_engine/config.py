"""GRPOConfig: the numbers and switches of a run (components are objects, not config strings).

Every model here is a frozen pydantic record with ``extra="forbid"``: a misspelled field is an
error, and one :class:`ConfigError` lists every bad field at once, each with its value, the rule it
breaks and the fix; an unknown name gets the closest field, or where TRL's name of it lives here.
``to_yaml`` / ``from_yaml`` round-trip a config through YAML. Batch vocabulary (units in the names):

- ``prompts_per_step`` (B): prompts sampled for one optimizer step.
- ``group_size`` (G): completions sampled per prompt; ``completions_per_step`` = B * G, derived.
- ``updates_per_batch`` (μ): policy updates on one rollout batch.
- ``max_prompt_tokens``, ``max_completion_tokens``: token limits.

:func:`lr_factor` is the learning-rate schedule: a linear warm-up, (step + 1) / (warmup_steps + 1), then
constant, linear or cosine over the run's progress, the larger of the step fraction and (with
``max_train_seconds``) the time fraction; under ``time_budget="calibrated"`` the step fraction of the
run's planned steps (:func:`planned_steps`). It peaks at ``learning_rate``, higher for a run shorter than
``lr_reference_steps`` (:func:`peak_learning_rate`). Memory settings live in
:class:`grpo_engine.memory.MemoryPlan`.
"""

from __future__ import annotations

import difflib
import math
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

__all__ = ["ConfigError", "FrozenModel", "GRPOConfig", "format_validation_error", "load_yaml", "dump_yaml",
           "lr_factor", "peak_learning_rate", "planned_steps", "advance_clock", "run_finished"]

M = TypeVar("M", bound="FrozenModel")


Rule = tuple[Callable[[Any], bool], str, str]  # (is the value fine?, the rule, the fix)


class ConfigError(ValueError):
    """Bad settings: one line per problem, each with its place, value, rule and fix."""

    def __init__(self, message: str, validation_error: ValidationError) -> None:
        super().__init__(message)
        self.validation_error = validation_error

    def errors(self) -> list[dict[str, Any]]:
        """pydantic's records of the problems (``loc``, ``msg``, ``type``...)."""
        return self.validation_error.errors()


class FrozenModel(BaseModel):
    """Base for every config record: frozen, no unknown fields, YAML in and out.

    A subclass lists its value rules in ``field_rules`` (field -> (check, rule, fix)). They are
    checked per field, so one :class:`ConfigError` lists every bad field (type errors included) at
    once, each message naming the value, the rule and the fix. ``renamed`` maps names users bring
    from other libraries (TRL) to where that setting lives here.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)
    field_rules: ClassVar[dict[str, Rule]] = {}
    renamed: ClassVar[dict[str, str]] = {}

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(
                format_validation_error(exc, type(self), title=type(self).__name__), exc
            ) from None

    # pydantic calls a custom __init__ when it validates a nested record, which would turn the nested
    # record's problems into one opaque line; marked as the base init, nested records keep their
    # per-field errors and only the outermost record raises ConfigError
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @classmethod
    def model_validate(cls: type[M], obj: Any, **kwargs: Any) -> M:
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, cls, title=cls.__name__), exc) from None

    @field_validator("*", mode="after")
    @classmethod
    def _check_field(cls, value: Any, info: ValidationInfo) -> Any:
        rule = cls.field_rules.get(info.field_name or "")
        if rule is not None and not rule[0](value):
            raise ValueError(f"{info.field_name}={value!r} {rule[1]}; {rule[2]}")
        return value

    def to_yaml(self, path: str | Path | None = None) -> str:
        """Returns the record as YAML text, and writes it to ``path`` when given."""
        text = dump_yaml(self.model_dump(mode="json"))
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_yaml(cls: type[M], source: str | Path) -> M:
        """Builds the record from a YAML file path or YAML text."""
        data = load_yaml(source)
        return cls.model_validate(data or {})


def format_validation_error(exc: ValidationError, model: type[FrozenModel],
                            title: str = "the configuration") -> str:
    """One line per problem, with its location, and for an unknown field the closest known name (or
    where another library's name for it lives here)."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(the whole record)"
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            field = str(err["loc"][-1])
            owner = _owner(model, err["loc"][:-1])
            known = list(owner.model_fields) if owner is not None else []
            match = difflib.get_close_matches(field, known, n=1)
            if owner is not None and field in owner.renamed:
                message = f"unknown field; {owner.renamed[field]}"
            elif owner is not None and _hint(owner, field):
                message = f"unknown field; {_hint(owner, field)}"
            elif match:
                message = f"unknown field; did you mean '{match[0]}'?"
            else:
                message = f"unknown field; known fields: {', '.join(known)}"
        elif err["type"] not in ("value_error", "assertion_error") and "input" in err:
            message = f"{message} (got {str(err['input'])[:60]!r})"
        lines.append(f"  - {loc}: {message}")
    return f"{len(lines)} problem(s) in {title}:\n" + "\n".join(lines)


# Where another library's setting lives here, for an unknown field of a record: hints registered by the
# modules that know that library (grpo_engine.trl.refused, imported by the package: TRL's 191 fields).
UNKNOWN_FIELD_HINTS: list[Callable[[type[FrozenModel], str], str | None]] = []


def _hint(owner: type[FrozenModel], field: str) -> str | None:
    return next((h for h in (hint(owner, field) for hint in UNKNOWN_FIELD_HINTS) if h), None)


def _owner(model: type[FrozenModel], path: tuple[Any, ...]) -> type[FrozenModel] | None:
    """The record found by following ``path`` (field names) from ``model``."""
    current: Any = model
    for part in path:
        if isinstance(part, int):  # an item of a list field
            continue
        field = current.model_fields.get(str(part)) if isinstance(current, type) else None
        if field is None:
            return None
        options = (field.annotation, *typing.get_args(field.annotation))
        current = next((t for t in options if isinstance(t, type) and issubclass(t, FrozenModel)), None)
    return current if isinstance(current, type) and issubclass(current, FrozenModel) else None


def load_yaml(source: str | Path) -> Any:
    """Reads YAML from a path (``Path`` or an existing file name) or from YAML text."""
    if isinstance(source, Path) or (
        isinstance(source, str) and "\n" not in source and Path(source).is_file()
    ):
        source = Path(source).read_text()
    return yaml.safe_load(source)


def dump_yaml(data: Any) -> str:
    """YAML text with keys in declaration order."""
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


class GRPOConfig(FrozenModel):
    """Numbers and switches of a GRPO run.

    Example:
        >>> cfg = GRPOConfig(prompts_per_step=4, group_size=8, max_completion_tokens=64)
        >>> cfg.completions_per_step
        32
    """

    # -- the batch ---------------------------------------------------------------------------
    prompts_per_step: int = Field(4, description="B: prompts sampled for each optimizer step.")
    group_size: int = Field(8, description="G: completions sampled per prompt; advantages compare a group.")
    updates_per_batch: int = Field(
        1, description="mu: policy updates on one rollout batch (1 = strictly on-policy, "
        "no old-logprob pass)."
    )
    max_prompt_tokens: int = Field(
        512, description="Longest rendered prompt; a longer one follows overlong_prompts."
    )
    overlong_prompts: Literal["truncate", "drop", "error"] = Field(
        "truncate", description="A training prompt over max_prompt_tokens: 'truncate' "
        "(lose the middle of the question, keep the chat template's head; warned, "
        "counted in prompts/truncated), 'drop' (removed when the trainer is built, with a warning) "
        "or 'error' (the trainer refuses to start, naming each one)."
    )
    max_completion_tokens: int = Field(
        256, description="Sampling stops here; such completions are 'truncated'."
    )
    max_steps: int = Field(100, description="Optimizer steps to run.")
    max_train_seconds: float | None = Field(
        None, description="Also stop once this many seconds have been spent in training steps "
        "(checked between steps; held-out evaluations and checkpoint saves do not count). "
        "The trainer's train_seconds is this clock."
    )

    # -- the model ---------------------------------------------------------------------------
    place_model: Literal["auto", "keep"] = Field(
        "auto", description="Where a model object passed to GRPOTrainer trains: 'auto' moves it to this "
        "rank's device (its GPU when there is one, as TRL does; logged), 'keep' leaves it where it is (under "
        "torchrun a model on a GPU still goes to this rank's GPU). A bitsandbytes-quantised model (4 or 8 "
        "bits) or one dispatched over several devices (hf_device_map) is never moved: it trains where it was "
        "loaded (logged). A model the trainer loads from a folder or hub id always goes to this rank's "
        "device."
    )

    # -- sampling ----------------------------------------------------------------------------
    temperature: float = Field(
        1.0, description="Sampling temperature; training log-probs are computed at the same temperature."
    )
    top_p: float = Field(1.0, description="Nucleus sampling mass (1.0 = off).")
    top_k: int = Field(0, description="Top-k sampling (0 = off).")

    # -- tools (GRPOTrainer(tools=..., environment_factory=...)) -------------------------------
    max_turns: int = Field(
        4, description="With tools: model turns per rollout (a rollout still calling a tool in its last "
        "turn stops there, counted in turns/limit_reached); max_completion_tokens bounds the whole rollout."
    )
    tool_timeout_s: float = Field(
        10.0, description="With tools: a call still running after this many seconds is reported to the "
        "model as timed out (tools/timeouts); its result is dropped, and when the call was an environment's "
        "the rollout ends there (turns/ended_by_timeout)."
    )
    max_tool_chars: int = Field(
        4000, description="With tools: characters of a tool's result the model reads; a longer one is "
        "cut and the model is told (tools/cut_outputs)."
    )

    # -- rewards -----------------------------------------------------------------------------
    reward_timeout_s: float | None = Field(
        120.0, description="A reward that has not scored a step's batch after this many seconds fails "
        "(RewardTimeout; null = wait forever)."
    )
    on_reward_error: Literal["raise", "zero"] = Field(
        "raise", description="A reward that fails or times out: 'raise' stops the run with its error; "
        "'zero' scores the failing samples 0 and counts them in reward/<name>/errors."
    )

    # -- optimisation ------------------------------------------------------------------------
    learning_rate: float = Field(
        1e-5, description="Peak learning rate (LoRA usually wants ~1e-4, full ~1e-6)."
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Decay after warm-up: constant, linear to 0, "
        "or cosine to 0 at the end of the run: max_steps, or max_train_seconds when that comes first "
        "(progress is the larger of the two fractions)."
    )
    warmup_steps: int = Field(0, description="Linear warm-up steps from 0 to learning_rate.")
    time_budget: Literal["clock", "calibrated"] = Field(
        "clock", description="How max_train_seconds bounds a run: 'clock' stops at the budget and the "
        "schedule follows whichever of steps or seconds ends first; 'calibrated' times the warm-up steps "
        "(their updates apart, see planned_steps), then fixes the run's step count to what fits the budget "
        "(at most max_steps) and follows that step schedule, so a seed gives the same run on a machine "
        "fast enough for max_steps (the budget still stops a run that slows down later)."
    )
    replan_step: int | None = Field(
        None, description="Under time_budget='calibrated': the step at whose end the plan is made once "
        "more, from the pace of the steps since the first plan (a warm-up's completions are often the "
        "run's longest, so its pace plans too few steps); null = the first plan holds. Until then the "
        "schedule follows max_steps (unless the first plan ends the run sooner), so the first plan's timing "
        "noise never reaches the learning rate."
    )
    plan_grid: int = Field(
        10, description="Under time_budget='calibrated': a plan short of max_steps is rounded down to a "
        "multiple of this (from twice it on), so that a small change of pace plans the same count; a "
        "coarser grid plans alike more often, at the cost of up to plan_grid - 1 steps of the budget."
    )
    lr_reference_steps: int | None = Field(
        None, description="A run of fewer steps than this (the calibrated plan, else max_steps) peaks "
        "higher: at learning_rate x lr_reference_steps / its steps, at most max_learning_rate, so that a "
        "slow machine's shorter run still learns (see peak_learning_rate); null = the peak is learning_rate."
    )
    max_learning_rate: float | None = Field(
        None, description="The highest peak lr_reference_steps may raise the learning rate to (needed "
        "with it)."
    )
    weight_decay: float = Field(0.0, description="AdamW weight decay.")
    adam_betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW (beta1, beta2).")
    adam_eps: float = Field(1e-8, description="AdamW epsilon.")
    max_grad_norm: float | None = Field(
        1.0, description="Clip the global gradient norm to this (null = off)."
    )
    max_nonfinite_steps: int = Field(
        3, description="A step whose rewards, advantages, loss or gradient norm is not finite is skipped "
        "(weights unchanged, counted in skipped_steps); the run stops after this many in a row."
    )

    # -- bookkeeping -------------------------------------------------------------------------
    seed: int = Field(0, description="Seeds prompt order, sampling and initialisation.")
    output_dir: str = Field("runs/grpo", description="Metrics, checkpoints and the final model go here.")
    log_every_steps: int = Field(1, description="Write a metrics line every this many steps.")
    save_every_steps: int | None = Field(
        None, description="Save a checkpoint every this many steps (null = end only)."
    )
    keep_last_checkpoints: int | None = Field(
        None, description="Keep only the newest this many checkpoint-N folders "
        "(null = keep all; final/ always stays)."
    )
    progress_bar: bool = Field(True, description="Show a console progress bar.")
    report_to: list[Literal["tensorboard", "wandb", "trackio"]] = Field(
        default_factory=list, description="Also log every step's metrics to these backends (metrics.jsonl "
        "is always written); each needs its optional extra, e.g. pip install 'grpo_engine[tensorboard]'."
    )
    log_token_entropy: bool = Field(
        True, description="Log the exact mean token entropy from the training pass (one extra softmax over "
        "the vocabulary per trained token; always computed when the loss needs it)."
    )

    @property
    def completions_per_step(self) -> int:
        """N = prompts_per_step * group_size."""
        return self.prompts_per_step * self.group_size

    @field_validator("time_budget")
    @classmethod
    def _calibration_inputs(cls, value: str, info: ValidationInfo) -> str:
        if value == "calibrated" and info.data.get("max_train_seconds", 0) is None:
            raise ValueError("time_budget='calibrated' fits the run's steps to max_train_seconds, which is "
                             "null; set max_train_seconds (e.g. 450) or use time_budget='clock'")
        if value == "calibrated" and info.data.get("warmup_steps", 1) < 1:
            raise ValueError("time_budget='calibrated' times the warm-up steps, and warmup_steps=0; set "
                             "warmup_steps >= 1 (e.g. 4)")
        return value

    @field_validator("replan_step")
    @classmethod
    def _replan_inputs(cls, value: int | None, info: ValidationInfo) -> int | None:
        budget, warmup = info.data.get("time_budget"), info.data.get("warmup_steps", 0)
        if value is not None and budget != "calibrated":
            raise ValueError(f"replan_step={value} revises a calibrated budget's plan, and time_budget="
                             f"{budget!r}; set time_budget='calibrated' or replan_step=None")
        if value is not None and warmup is not None and value <= warmup:
            raise ValueError(f"replan_step={value} must come after the warm-up (warmup_steps={warmup}), "
                             f"which makes the first plan; set replan_step > {warmup} (e.g. {5 * warmup})")
        return value

    @field_validator("max_learning_rate")
    @classmethod
    def _raised_peak_inputs(cls, value: float | None, info: ValidationInfo) -> float | None:
        reference, learning_rate = info.data.get("lr_reference_steps"), info.data.get("learning_rate")
        if reference is not None and value is None:
            raise ValueError(f"lr_reference_steps={reference} raises the peak of a shorter run, and the cap "
                             "max_learning_rate is null; set max_learning_rate (e.g. 4e-4 with learning_rate "
                             "3e-4), or lr_reference_steps=None")
        if value is not None and learning_rate is not None and value < learning_rate:
            raise ValueError(f"max_learning_rate={value} is below learning_rate={learning_rate}, and a "
                             f"raised peak is never lower; set max_learning_rate >= {learning_rate}")
        return value


_TRL = "TRL's {} is {} here"
GRPOConfig.renamed = {
    "num_generations": _TRL.format("num_generations", "group_size"),
    "max_completion_length": _TRL.format("max_completion_length", "max_completion_tokens"),
    "max_prompt_length": _TRL.format("max_prompt_length", "max_prompt_tokens"),
    "num_iterations": _TRL.format("num_iterations", "updates_per_batch"),
    "per_device_train_batch_size": "TRL's per_device_train_batch_size counts completions; "
    "here a step samples prompts_per_step prompts x group_size completions",
    "generation_batch_size": "TRL's generation_batch_size counts completions; here a step samples "
    "prompts_per_step prompts x group_size completions",
    "gradient_accumulation_steps": "here the step's completions are cut into micro-batches of "
    "MemoryPlan.micro_batch_size (memory.micro_batch_size), with the gradient of the whole step",
    "beta": "TRL's beta is the KL coefficient of the loss here: loss=ClippedSurrogate(kl_coef=0.04)",
    "epsilon": "TRL's epsilon is the loss's clip here: loss=ClippedSurrogate(clip_eps_low=0.2)",
    "epsilon_high": "TRL's epsilon_high is the loss's upper clip here: "
    "loss=ClippedSurrogate(clip_eps_high=0.28)",
    "loss_type": "TRL's loss_type is a choice of components here: see grpo_engine.presets "
    "(grpo, dr_grpo, dapo, gspo, cispo)",
    "scale_rewards": "TRL's scale_rewards is the advantage's std_scope here: advantage=GroupNormalized("
    "std_scope='group' | 'batch' | 'none')",
    "mask_truncated_completions": "here truncated completions are masked by a loss term: "
    "ClippedSurrogate(terms=[MaskTruncated()])",
    "num_train_epochs": "here a run is max_steps steps (or max_train_seconds)",
    "logging_steps": _TRL.format("logging_steps", "log_every_steps"),
    "save_steps": _TRL.format("save_steps", "save_every_steps"),
    "save_total_limit": _TRL.format("save_total_limit", "keep_last_checkpoints"),
    "lr_scheduler_type": _TRL.format("lr_scheduler_type", "lr_schedule"),
    "adam_beta1": "TRL's adam_beta1 and adam_beta2 are adam_betas=(0.9, 0.99) here",
    "adam_beta2": "TRL's adam_beta1 and adam_beta2 are adam_betas=(0.9, 0.99) here",
    "adam_epsilon": _TRL.format("adam_epsilon", "adam_eps"),
    "bf16": "mixed precision is MemoryPlan(compute_dtype='bfloat16') here (memory.compute_dtype)",
    "fp16": "mixed precision is MemoryPlan(compute_dtype='float16') here (memory.compute_dtype)",
    "gradient_checkpointing": "it is MemoryPlan(gradient_checkpointing=True) here "
    "(memory.gradient_checkpointing)",
    "reward_weights": "here each reward carries its weight: MathAccuracy(weight=1.0)",
    "max_tool_calling_iterations": "TRL's max_tool_calling_iterations (rounds of tool calls) is "
    "max_turns - 1 here (max_turns counts the model's turns)",
    "resume_from_checkpoint": "resume with GRPOTrainer(..., resume_from='latest') (CLI: --resume)",
}

GRPOConfig.field_rules = {
    **{
        name: (lambda v: v >= 1, "must be >= 1", f"set {name} to a positive integer")
        for name in ("prompts_per_step", "updates_per_batch", "max_prompt_tokens", "max_completion_tokens",
                     "max_steps", "log_every_steps", "max_nonfinite_steps", "max_turns", "max_tool_chars")
    },
    "group_size": (lambda v: v >= 2, "makes every advantage 0 (a group needs at least two completions to "
                   "compare)", "use group_size >= 2"),
    "tool_timeout_s": (lambda v: v > 0, "must be > 0 seconds", "use e.g. tool_timeout_s=10"),
    "temperature": (lambda v: v > 0, "must be > 0 (GRPO samples)",
                    "use a temperature in (0, 2], typically 0.7-1.0"),
    "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1]", "use top_p=1.0 to turn it off"),
    "top_k": (lambda v: v >= 0, "must be >= 0", "use top_k=0 to turn it off"),
    "learning_rate": (lambda v: v > 0, "must be > 0", "use e.g. 1e-4 for LoRA or 1e-6 for full fine-tuning"),
    "warmup_steps": (lambda v: v >= 0, "must be >= 0", "use 0 for no warm-up"),
    "plan_grid": (lambda v: v >= 1, "must be >= 1", "use e.g. 10 (1: no rounding)"),
    "lr_reference_steps": (lambda v: v is None or v >= 1, "must be >= 1",
                           "use e.g. 80, or null to keep the peak at learning_rate"),
    "max_learning_rate": (lambda v: v is None or v > 0, "must be > 0",
                          "use e.g. 4e-4 with learning_rate 3e-4"),
    "weight_decay": (lambda v: v >= 0, "must be >= 0", "use 0.0 to turn it off"),
    "adam_betas": (lambda v: all(0 <= b < 1 for b in v), "must each be in [0, 1)", "use (0.9, 0.99)"),
    "adam_eps": (lambda v: v > 0, "must be > 0", "use 1e-8"),
    "max_grad_norm": (lambda v: v is None or v > 0, "must be > 0", "use null to turn clipping off"),
    "max_train_seconds": (lambda v: v is None or v > 0, "must be > 0", "use null for no time limit"),
    "reward_timeout_s": (lambda v: v is None or v > 0, "must be > 0",
                         "use e.g. 120, or null to wait forever"),
    "save_every_steps": (lambda v: v is None or v >= 1, "must be >= 1", "use null to save only at the end"),
    "keep_last_checkpoints": (lambda v: v is None or v >= 1, "must be >= 1",
                              "use null to keep every checkpoint"),
}


def lr_factor(config: GRPOConfig, step: int, train_seconds: float = 0.0, planned: int | None = None) -> float:
    """The learning-rate multiplier of ``step``: linear warm-up, then the schedule over the run's
    progress: the step fraction of ``planned`` steps (a calibrated budget's, :func:`planned_steps`), or
    the larger of the step fraction of ``max_steps`` and (with ``max_train_seconds`` and the ``"clock"``
    budget) the time fraction; a calibrated run not yet planned follows the step fraction of ``max_steps``.
    After the warm-up the schedule starts from :func:`peak_learning_rate` / ``learning_rate`` (1 unless
    ``lr_reference_steps`` raises it). With ``replan_step``, the steps before it follow ``max_steps``
    whatever the first plan (unless that plan ends the run by the replan), so two runs whose warm-ups
    timed a little differently take the same learning rates.

    Example:
        >>> lr_factor(GRPOConfig(lr_schedule="linear", max_steps=10), 5)
        0.5
    """
    if step < config.warmup_steps:
        return (step + 1) / (config.warmup_steps + 1)
    replan = config.replan_step
    if planned is not None and replan is not None and step < replan < planned:
        planned = None  # the first plan, a rough guess, only stops the run: until the replan, max_steps
    total = min(planned, config.max_steps) if planned is not None else config.max_steps
    progress = (step - config.warmup_steps) / max(1, total - config.warmup_steps)
    if config.max_train_seconds is not None and planned is None and config.time_budget == "clock":
        progress = max(progress, train_seconds / config.max_train_seconds)
    peak = peak_learning_rate(config, planned) / config.learning_rate
    if config.lr_schedule == "linear":
        return peak * max(0.0, 1.0 - progress)
    if config.lr_schedule == "cosine":
        return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return peak


def peak_learning_rate(config: GRPOConfig, planned: int | None = None) -> float:
    """The peak the schedule decays from after the warm-up: ``learning_rate``, or for a run of fewer steps
    than ``lr_reference_steps`` (its ``planned`` steps under the calibrated budget, else ``max_steps``)
    ``learning_rate * lr_reference_steps / steps``, at most ``max_learning_rate``. The warm-up climbs
    to ``learning_rate`` whatever the peak (the calibration runs before the plan is known).

    Example:
        >>> config = GRPOConfig(learning_rate=3e-4, lr_reference_steps=90, max_learning_rate=4e-4)
        >>> [round(peak_learning_rate(config, steps), 7) for steps in (100, 90, 80, 60, 30)]
        [0.0003, 0.0003, 0.0003375, 0.0004, 0.0004]
    """
    steps = min(planned, config.max_steps) if planned is not None else config.max_steps
    if config.lr_reference_steps is None or steps >= config.lr_reference_steps:
        return config.learning_rate
    raised = config.learning_rate * config.lr_reference_steps / steps
    return min(raised, typing.cast(float, config.max_learning_rate))


CALIBRATION_MARGIN = 0.95  # of the budget left after the warm-up: later steps may run slower


def advance_clock(config: GRPOConfig, state: Any, seconds: dict[str, float], *, updated: bool) -> None:
    """Counts a finished step's ``time/step_s`` into ``state.train_seconds`` (the budget's clock) and, when
    some row had a gradient to compute (``updated``), its ``time/train_s`` into ``state.update_seconds``
    and the step into ``state.update_steps``; then fixes ``state.planned_steps``
    (:func:`planned_steps`), marking the clock where the first plan was made in ``state.plan_mark``.
    ``state``: a ``TrainerState``."""
    state.train_seconds += seconds["time/step_s"]
    if updated:
        state.update_steps += 1
        state.update_seconds += seconds.get("time/train_s", 0.0)
    first = state.planned_steps is None
    state.planned_steps = planned_steps(config, state)
    if first and state.planned_steps is not None:
        state.plan_mark = (state.step, state.train_seconds, state.update_steps, state.update_seconds)


def planned_steps(config: GRPOConfig, state: Any) -> int | None:
    """The run's step count under ``time_budget="calibrated"``: planned at the end of the warm-up
    (``state.step == warmup_steps``), or later, at the end of the first step that updates the policy when
    no warm-up step did; and with ``replan_step``, planned once more at the end of that step, from the
    steps since the first plan (``state.plan_mark``). A step is estimated to take the mean time of the
    steps timed less their update time, plus the mean update time of those that updated (early steps
    whose groups all tie compute no gradient, and timing them as whole steps would plan too many).
    ``max_steps`` when they fit in ``max_train_seconds`` at that pace (with a 5% margin), else as many as
    fit, rounded down to a multiple of ``plan_grid`` (so that small timing noise plans the same count);
    ``state.planned_steps`` unchanged at every other step. ``state``: a ``TrainerState``.

    Example:
        >>> from grpo_engine.callbacks import TrainerState
        >>> config = GRPOConfig(max_steps=120, max_train_seconds=450, warmup_steps=4,
        ...                     time_budget="calibrated", replan_step=20)
        >>> fast = TrainerState(step=4, train_seconds=10.0, update_steps=2, update_seconds=2.0)
        >>> slow = TrainerState(step=4, train_seconds=24.0, update_steps=2, update_seconds=8.0)
        >>> planned_steps(config, fast), planned_steps(config, slow)  # 3 s and 8 s a step
        (120, 50)
        >>> later = TrainerState(step=20, train_seconds=24.0 + 16 * 6.0, update_steps=18,
        ...                      update_seconds=8.0 + 16 * 2.0, planned_steps=50,
        ...                      plan_mark=(4, 24.0, 2, 8.0))
        >>> planned_steps(config, later)  # 6 s a step since the warm-up: 20 + int(0.95 x 330 / 6) = 72
        70
    """
    planned, step = state.planned_steps, state.step
    if config.time_budget != "calibrated" or step < config.warmup_steps:
        return planned
    if planned is None:
        if state.update_steps == 0:  # nothing yet says what an update costs
            return None
        mean_update = state.update_seconds / state.update_steps
        pace = (state.train_seconds - state.update_seconds) / step + mean_update
        return _fitting_steps(config, step, state.train_seconds, pace)
    if step != config.replan_step or planned <= step or state.plan_mark is None:
        return planned
    marked_step, marked_seconds, marked_updates, marked_update_seconds = state.plan_mark
    updates = state.update_steps - marked_updates
    update_seconds = state.update_seconds - marked_update_seconds
    # none since the first plan: the run's mean update
    mean_update = update_seconds / updates if updates else state.update_seconds / state.update_steps
    pace = (state.train_seconds - marked_seconds - update_seconds) / (step - marked_step) + mean_update
    return _fitting_steps(config, step, state.train_seconds, pace)


def _fitting_steps(config: GRPOConfig, step: int, seconds: float, pace: float) -> int:
    """The steps that fit ``max_train_seconds`` after ``step`` steps and ``seconds`` at ``pace`` (with
    the margin), at most ``max_steps``, rounded down to a multiple of ``plan_grid`` from twice it on."""
    left = (config.max_train_seconds - seconds) * CALIBRATION_MARGIN
    fits = step + int(left / max(pace, 1e-9))
    if fits >= config.max_steps:
        return config.max_steps
    grid = config.plan_grid
    return max(step, fits - fits % grid if fits >= 2 * grid else fits)


def run_finished(config: GRPOConfig, state: Any) -> bool:
    """Whether a run is over (checked between steps): ``state.step`` reached ``max_steps`` or the planned
    steps of a calibrated budget (the fewer), or ``state.train_seconds`` reached ``max_train_seconds``
    (a calibrated run too, should it slow down). ``state``: a ``TrainerState``."""
    if state.step >= min(config.max_steps, state.planned_steps or config.max_steps):
        return True
    return config.max_train_seconds is not None and state.train_seconds >= config.max_train_seconds
