"""RunSpec: a whole training run as one YAML file, the input of ``grpo-engine train``.

Numbers and switches are the Python API's records (``config``: GRPOConfig, ``memory``: MemoryPlan);
components (``train_prompts``, ``rewards``, ``advantage``, ``loss``, ...) an import path and keywords::

    model: HuggingFaceTB/SmolLM2-135M-Instruct
    train_prompts: {function: grpo_engine.data.load_gsm8k, path: data/gsm8k/train.jsonl}
    rewards: [{class: grpo_engine.rewards.MathAccuracy},
              {class: grpo_engine.rewards.BoxedFormat, weight: 0.1}]
    loss: {class: grpo_engine.losses.ClippedSurrogate, clip_eps_high: 0.28}
    config: {prompts_per_step: 4, group_size: 8}
    memory: {lora: {r: 16}, micro_batch_size: 8}

The CLI builds the objects; the core only sees objects. An import path runs code: a run file may name
``grpo_engine.*`` freely, anything else only under a module listed in ``imports:`` (read that code
before running a shared file). Model output is never executed.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from typing import Any, Literal

from pydantic import Field, model_serializer, model_validator

from grpo_engine.config import ConfigError, FrozenModel, GRPOConfig, format_validation_error
from grpo_engine.memory.plan import MemoryPlan

__all__ = ["BuildError", "ComponentSpec", "ConfigError", "RunSpec", "build", "format_validation_error",
           "load", "loss_of", "rewards_of", "trusted"]


class ComponentSpec(FrozenModel):
    """``{class: import.path.Name, **kwargs}`` (or ``function:`` for a factory function, or
    ``reward_function:`` for a plain reward function, wrapped with its ``weight`` / ``name``)."""

    model_config = FrozenModel.model_config | {"extra": "allow"}

    target: str = Field(description="Import path of the class or function to call.")
    kind: Literal["call", "reward_function"] = Field(
        "call", description="Call the target, or wrap it as a reward.")

    @model_validator(mode="before")
    @classmethod
    def _alias(cls, data: Any) -> Any:
        if isinstance(data, str):
            return {"target": data}
        if isinstance(data, dict):
            keys = [k for k in ("class", "function", "reward_function", "target") if k in data]
            if len(keys) != 1:
                raise ValueError("a component needs exactly one of 'class', 'function' or 'reward_function' "
                                 f"(got keys {sorted(data)}); write e.g. "
                                 "{class: grpo_engine.rewards.MathAccuracy, weight: 1.0}")
            data = dict(data)
            data["target"] = data.pop(keys[0])
            if keys[0] == "reward_function":
                data["kind"] = "reward_function"
        return data

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        kind, target = data.pop("kind", "call"), data.pop("target")
        return {("reward_function" if kind == "reward_function" else "target"): target, **data}

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
    reward_normalize: Literal["after_sum", "each"] = Field(
        "after_sum", description="How the rewards combine (WeightedSum's normalize): 'after_sum' sums the "
        "raw scores; 'each' z-scores each reward in its group first (GDPO, with advantage "
        "grpo_engine.advantages.ReinforcePlusPlusBaseline).")
    reward_eps: float = Field(1e-6, ge=0, description="eps of 'each' (TRL's normalize_then_sum: 1e-4).")
    advantage: ComponentSpec | None = Field(None, description="AdvantageFn; default group z-score.")
    loss: ComponentSpec | None = Field(None, description="GRPOLoss; default ClippedSurrogate().")
    template: ComponentSpec | None = Field(None, description="Prompt template; default the chat template.")
    sampler: ComponentSpec | None = Field(
        None, description="Sampler, or a group filter (e.g. grpo_engine.sampling.DynamicSampling); "
        "default HFSampler.")
    entropy: ComponentSpec | None = Field(
        None, description="EntropyEstimator (per-group uncertainty); default none.")
    callbacks: list[ComponentSpec] = Field(
        default_factory=list, description="Callbacks (grpo_engine.callbacks).")
    config: GRPOConfig = Field(default_factory=GRPOConfig, description="Numbers and switches (GRPOConfig).")
    memory: MemoryPlan = Field(default_factory=MemoryPlan, description="Memory plan (MemoryPlan).")
    imports: list[str] = Field(
        default_factory=list, description="Modules outside grpo_engine whose classes and functions this file "
        "may call, e.g. [my_rewards]; their code runs, so read it before running a shared file.")

    @model_validator(mode="after")
    def _trusted(self) -> RunSpec:
        outside = [c.target for c in self.components() if not trusted(c.target, self.imports)]
        if outside:
            raise ValueError(f"{outside} are outside grpo_engine and not under a module listed "
                             "in 'imports:'; an import path runs that module's code: read it, then add "
                             f"its module to 'imports:' (e.g. imports: [{outside[0].rpartition('.')[0]}])")
        return self

    def components(self) -> list[ComponentSpec]:
        """Every component of the file, in order."""
        single = [self.train_prompts, self.advantage, self.loss, self.template, self.sampler, self.entropy]
        return [c for c in [*single, *self.rewards, *self.callbacks] if c is not None]


def trusted(target: str, imports: list[str]) -> bool:
    """Whether ``target`` is under ``grpo_engine`` or under one of the ``imports`` modules."""
    return any(target.startswith(module + ".") for module in ("grpo_engine", *imports))


class BuildError(ValueError):
    """A component of a run file that cannot be imported or built (with the closest name, when one is)."""


def build(spec: ComponentSpec) -> Any:
    """Imports ``spec.target`` and calls it with ``spec.kwargs``.

    Raises:
        BuildError: the import path does not resolve (naming the closest match), or the call fails.
    """
    target = load(spec.target)
    try:
        if spec.kind == "reward_function":
            from grpo_engine.rewards.function import FunctionReward

            return FunctionReward(target, **spec.kwargs)
        return target(**spec.kwargs)
    except (TypeError, ValueError) as exc:
        raise BuildError(f"cannot build {spec.target} with {spec.kwargs}: {exc}") from exc


def load(target: str) -> Any:
    """The object at an import path, ``package.module.Name`` or ``package.module:Name``: imported, not called.

    Raises:
        BuildError: the path does not resolve (naming the closest match).

    Example:
        >>> load("grpo_engine.rewards:MathAccuracy").__name__
        'MathAccuracy'
    """
    module_name, _, attr = target.rpartition(":" if ":" in target else ".")
    if not module_name or not attr:
        raise BuildError(f"{target!r} is not an import path; write e.g. "
                         "grpo_engine.rewards.MathAccuracy")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BuildError(f"cannot import {target!r}: no module {module_name!r}"
                         f"{_closest_module(module_name)}") from exc
    if not hasattr(module, attr):
        names = [n for n in dir(module) if not n.startswith("_")]
        match = difflib.get_close_matches(attr, names, n=1)
        hint = f"; did you mean '{module_name}.{match[0]}'?" if match else ""
        raise BuildError(f"cannot import {target!r}: {module_name} has no {attr!r}{hint}")
    return getattr(module, attr)


def rewards_of(spec: RunSpec) -> Any:
    """The run's rewards: the built list, or a ``WeightedSum`` of it when ``reward_normalize`` /
    ``reward_eps`` are not the defaults (GDPO: ``reward_normalize: each``, ``reward_eps: 1e-4``)."""
    rewards = [build(r) for r in spec.rewards]
    if spec.reward_normalize == "after_sum" and spec.reward_eps == 1e-6:
        return rewards
    from grpo_engine.rewards.compose import WeightedSum

    return WeightedSum(rewards, normalize=spec.reward_normalize, eps=spec.reward_eps)


def loss_of(spec: RunSpec, callbacks: list[Any]) -> Any:
    """The run's loss (None: the trainer's default), with each of ``callbacks`` that is also a loss term
    (``AdaptiveEntropyBonus``: one object the loss reads and the step end updates) among its terms, so
    that a run file lists it once, under ``callbacks``.

    Raises:
        BuildError: such a callback with a loss that takes no terms (only ``ClippedSurrogate`` does).
    """
    import dataclasses

    from grpo_engine.losses.clipped import ClippedSurrogate
    from grpo_engine.protocols import LossTerm

    loss = build(spec.loss) if spec.loss else None
    joining = tuple(c for c in callbacks if isinstance(c, LossTerm))
    if not joining:
        return loss
    if loss is None:
        return ClippedSurrogate(terms=joining)
    if not isinstance(loss, ClippedSurrogate):
        raise BuildError(f"callbacks {[type(c).__name__ for c in joining]} are loss terms too, and "
                         f"{type(loss).__name__} takes no terms; use loss: {{class: "
                         "grpo_engine.losses.ClippedSurrogate, ...}, or leave them out")
    return dataclasses.replace(loss, terms=(*loss.terms, *joining))


def _closest_module(name: str) -> str:
    parent, _, leaf = name.rpartition(".")
    try:
        package = importlib.import_module(parent) if parent else None
    except ImportError:
        return ""
    if package is None or not hasattr(package, "__path__"):
        return ""
    match = difflib.get_close_matches(leaf, [m.name for m in pkgutil.iter_modules(package.__path__)], n=1)
    return f"; did you mean '{parent}.{match[0]}'?" if match else ""
