"""TRL 1.16's ``GRPOConfig`` by name: every field of ``trl.GRPOConfig`` (TRL's own and those it inherits from
``transformers.TrainingArguments``), with TRL's defaults (the table in :mod:`grpo_engine.trl.fields`), and
the values TRL's ``__post_init__`` derives resolved the same way:

- ``output_dir=None`` -> ``"trainer_output"``; ``bf16=None`` -> ``not fp16``; ``gradient_checkpointing`` and
  ``activation_checkpointing`` are one setting (TRL's default: on); ``disable_tqdm=None`` -> whether the
  ``transformers`` logger is quieter than warnings; ``report_to="none"`` -> ``[]``, a string -> a list;
- ``eval_strategy="steps"`` without ``eval_steps`` -> ``logging_steps``; ``do_eval`` when evaluating;
- the generation batch: ``steps_per_generation`` defaults to ``gradient_accumulation_steps`` and
  ``generation_batch_size`` to ``per_device_train_batch_size x WORLD_SIZE x steps_per_generation``; each
  derived from the other when one is given; it must hold whole groups of ``num_generations``;
- ``pad_to_multiple_of="auto"`` -> None (off the Neuron devices); ``debug`` -> a list;
  ``include_num_input_tokens_seen`` True / False -> ``"all"`` / ``"no"``;
- ``scale_rewards`` True / False -> ``"group"`` / ``"none"``; ``epsilon_high=None`` -> ``epsilon``;
  ``vllm_importance_sampling_cap`` (deprecated) -> ``vllm_importance_sampling_clip_max``.

An unknown keyword is a ``TypeError``, as for any dataclass. The record stays a plain mutable dataclass, as
TRL's is; what it means here is decided when a trainer is built (:mod:`grpo_engine.trl.mapping`).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import os
from typing import Any

from grpo_engine.trl.fields import TRL_FIELDS, TRL_TYPES

__all__ = ["GRPOConfig"]


def _field(default: Any) -> Any:
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default))
    return dataclasses.field(default=default)


_Fields = dataclasses.make_dataclass(  # typed as TRL's, over builtins: HfArgumentParser parses them
    "_Fields", [(name, eval(TRL_TYPES[name], {"Any": Any}), _field(d)) for name, d in TRL_FIELDS.items()])


class GRPOConfig(_Fields):
    """TRL 1.16's ``GRPOConfig``: the same fields, names and defaults (module docstring).

    Example:
        >>> args = GRPOConfig(output_dir="run", num_generations=4, max_completion_length=64)
        >>> args.generation_batch_size, args.bf16, args.gradient_checkpointing, args.loss_type
        (8, True, True, 'dapo')
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for name in kwargs:
            if name not in TRL_FIELDS:
                near = difflib.get_close_matches(name, TRL_FIELDS, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise TypeError(f"GRPOConfig.__init__() got an unexpected keyword argument {name!r}{hint}")
        super().__init__(*args, **kwargs)
        self.__post_init__()  # the generated __init__ of the field table has no hook of its own

    def __post_init__(self) -> None:
        if self.output_dir is None:
            self.output_dir = "trainer_output"
        self.output_dir = os.path.expanduser(str(self.output_dir))
        if self.bf16 is None:
            self.bf16 = not self.fp16
        if self.fp16 and self.bf16:
            raise ValueError("At most one of fp16 and bf16 can be True, but not both")
        if self.activation_checkpointing is None and self.gradient_checkpointing is not None:
            self.activation_checkpointing = self.gradient_checkpointing
        self.gradient_checkpointing = self.activation_checkpointing = bool(self.activation_checkpointing)
        if self.disable_tqdm is None:
            self.disable_tqdm = logging.getLogger("transformers").getEffectiveLevel() > logging.WARN
        if self.report_to in ("none", ["none"], None):
            self.report_to = []
        elif isinstance(self.report_to, str):
            self.report_to = [self.report_to]
        if self.pad_to_multiple_of == "auto":
            self.pad_to_multiple_of = None  # TRL: 128 on Neuron only
        if isinstance(self.debug, str) or self.debug is None:
            self.debug = (self.debug or "").split()
        if isinstance(self.include_num_input_tokens_seen, bool):
            self.include_num_input_tokens_seen = "all" if self.include_num_input_tokens_seen else "no"
        if str(self.eval_strategy) == "steps" and not self.eval_steps:
            self.eval_steps = self.logging_steps
        if str(self.eval_strategy) != "no":
            self.do_eval = True
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if self.vllm_importance_sampling_cap is not None:
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        self._generation_batch()

    def _generation_batch(self) -> None:
        """TRL's rule for the generation batch (completions sampled at once, across every process)."""
        per_step = self.per_device_train_batch_size * self.world_size
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ValueError("'generation_batch_size' and 'steps_per_generation' can not be both configured "
                             "at the same time")
        if self.generation_batch_size is None:
            if self.steps_per_generation is None:
                self.steps_per_generation = self.gradient_accumulation_steps
            self.generation_batch_size = per_step * self.steps_per_generation
        elif self.generation_batch_size % per_step:
            raise ValueError(f"generation_batch_size ({self.generation_batch_size}) must be divisible by the "
                             f"global batch size ({per_step}).")
        else:
            self.steps_per_generation = self.generation_batch_size // per_step
        if self.generation_batch_size % self.num_generations:
            raise ValueError(f"generation_batch_size ({self.generation_batch_size}) must be divisible by "
                             f"num_generations ({self.num_generations}).")
        if self.num_generations < 2:
            raise ValueError("GRPO requires at least 2 generations per prompt to calculate the advantages. "
                             f"You provided {self.num_generations}, which is less than the minimum required.")

    @property
    def world_size(self) -> int:
        """The processes of the launch (``WORLD_SIZE``, set by torchrun; 1 otherwise)."""
        return int(os.environ.get("WORLD_SIZE", "1"))
