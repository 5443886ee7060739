"""RunSpec: a whole training run as one YAML file, the input of ``grpo-engine train``.

Numbers and switches are the pydantic records of the Python API (``config``: GRPOConfig, ``memory``:
MemoryPlan). Components (``train_prompts``, ``rewards``; optional ``advantage``, ``loss``, ``template``,
``sampler``, ``entropy``, ``callbacks``) are an import path plus keyword arguments::

    model: HuggingFaceTB/SmolLM2-135M-Instruct
    train_prompts: {function: grpo_engine.data.load_gsm8k, path: data/gsm8k/train.jsonl}
    rewards: [{class: grpo_engine.rewards.MathAccuracy}, {class: grpo_engine.rewards.BoxedFormat, weight: 0.1}]
    loss: {class: grpo_engine.losses.ClippedSurrogate, clip_eps_high: 0.28}
    config: {prompts_per_step: 4, group_size: 8}
    memory: {lora: {r: 16}, micro_batch_size: 8}

The CLI builds the objects; the core only ever sees objects. An import path runs code: a run file may
name ``grpo_engine.*`` freely, and anything else only under a module listed in ``imports:`` (read that
code before running a file someone shared). Model output is never executed.
"""

from __future__ import annotations

import difflib
import importlib
import typing
from typing import Any

from pydantic import Field, ValidationError, model_validator

from grpo_engine.config import FrozenModel, GRPOConfig
from grpo_engine.memory.plan import MemoryPlan

__all__ = ["ComponentSpec", "RunSpec", "build", "format_validation_error", "trusted"]


class ComponentSpec(FrozenModel):
    """``{class: import.path.Name, **kwargs}`` (or ``function:`` for a factory function)."""

    model_config = FrozenModel.model_config | {"extra": "allow"}

    target: str = Field(description="Import path of the class or function to call.")

    @model_validator(mode="before")
    @classmethod
    def _alias(cls, data: Any) -> Any:
        if isinstance(data, str):
            return {"target": data}
        if isinstance(data, dict):
            keys = [k for k in ("class", "function", "target") if k in data]
            if len(keys) != 1:
                raise ValueError(f"a component needs exactly one of 'class' or 'function' (got keys {sorted(data)}); "
                                 "write e.g. {class: grpo_engine.rewards.MathAccuracy, weight: 1.0}")
            data = dict(data)
            data["target"] = data.pop(keys[0])
        return data

    @property
    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the call."""
        return dict(self.model_extra or {})


class RunSpec(FrozenModel):
    """Everything ``grpo-engine train`` needs."""

    model: str = Field(description="Local folder in transformers layout, or a hub id.")
    train_prompts: ComponentSpec = Field(
        description="A function returning the training prompts (a (train, test) pair uses train).")
    rewards: list[ComponentSpec] = Field(description="Reward components; their weights combine them.")
    advantage: ComponentSpec | None = Field(None, description="AdvantageFn; default group z-score.")
    loss: ComponentSpec | None = Field(None, description="GRPOLoss; default ClippedSurrogate().")
    template: ComponentSpec | None = Field(None, description="Prompt template; default the chat template.")
    sampler: ComponentSpec | None = Field(
        None, description="Sampler or sampler wrapper (e.g. grpo_engine.sampling.DynamicSampling); default HFSampler.")
    entropy: ComponentSpec | None = Field(None, description="EntropyEstimator (per-group uncertainty); default none.")
    callbacks: list[ComponentSpec] = Field(default_factory=list, description="Callbacks (grpo_engine.callbacks).")
    config: GRPOConfig = Field(default_factory=GRPOConfig, description="Numbers and switches (GRPOConfig).")
    memory: MemoryPlan = Field(default_factory=MemoryPlan, description="Memory plan (MemoryPlan).")
    imports: list[str] = Field(
        default_factory=list, description="Modules outside grpo_engine whose classes and functions this file may "
        "call, e.g. [my_rewards]; their code runs, so read it before running a shared file.")

    @model_validator(mode="after")
    def _trusted(self) -> RunSpec:
        outside = [c.target for c in self.components() if not trusted(c.target, self.imports)]
        if outside:
            raise ValueError(f"{outside} are outside grpo_engine and not under a module listed in 'imports:'; an "
                             "import path runs that module's code: read it, then add its module to 'imports:' "
                             f"(e.g. imports: [{outside[0].rpartition('.')[0]}])")
        return self

    def components(self) -> list[ComponentSpec]:
        """Every component of the file, in order."""
        single = [self.train_prompts, self.advantage, self.loss, self.template, self.sampler, self.entropy]
        return [c for c in [*single, *self.rewards, *self.callbacks] if c is not None]


def trusted(target: str, imports: list[str]) -> bool:
    """Whether ``target`` is under ``grpo_engine`` or under one of the ``imports`` modules."""
    return any(target.startswith(module + ".") for module in ("grpo_engine", *imports))


def build(spec: ComponentSpec) -> Any:
    """Imports ``spec.target`` and calls it with ``spec.kwargs``."""
    module_name, _, attr = spec.target.rpartition(".")
    if not module_name:
        raise ValueError(f"{spec.target!r} is not an import path; write e.g. grpo_engine.rewards.MathAccuracy")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import {spec.target!r} ({exc}); check the spelling of the import path") from exc
    return target(**spec.kwargs)


def format_validation_error(exc: ValidationError, model: type[FrozenModel] = RunSpec) -> str:
    """One line per problem, with its location, and a close match for a misspelled field."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            field = str(err["loc"][-1])
            known = _known_fields(model, err["loc"][:-1])
            match = difflib.get_close_matches(field, known, n=1)
            hint = f"did you mean '{match[0]}'?" if match else f"known fields: {', '.join(known)}"
            message = f"unknown field; {hint}"
        lines.append(f"  - {loc}: {message}")
    return f"{len(lines)} problem(s) in the configuration:\n" + "\n".join(lines)


def _known_fields(model: type[FrozenModel], path: tuple[Any, ...]) -> list[str]:
    """Field names of the record found by following ``path`` from ``model``."""
    current: Any = model
    for part in path:
        field = current.model_fields.get(str(part)) if isinstance(current, type) else None
        if field is None:
            return []
        options = (field.annotation, *typing.get_args(field.annotation))
        current = next((t for t in options if isinstance(t, type) and issubclass(t, FrozenModel)), None)
    return list(current.model_fields) if isinstance(current, type) else []
