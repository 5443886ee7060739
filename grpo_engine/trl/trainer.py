"""TRL 1.16's ``GRPOTrainer`` constructor over the native :class:`grpo_engine.GRPOTrainer`.

Every parameter of ``trl.GRPOTrainer.__init__`` is accepted by name. ``model`` (a name, a folder or a model),
``reward_funcs`` (functions, weighted by ``args.reward_weights``), ``train_dataset``, ``eval_dataset`` (with
``eval_strategy`` ``"steps"`` or ``"epoch"``: :class:`~grpo_engine.callbacks.HeldOutEval`),
``processing_class`` (the tokenizer), ``callbacks`` (``grpo_engine.callbacks.Callback`` objects),
``peft_config`` (a peft ``LoraConfig``), ``quantization_config`` (a 4-bit NF4 base under it: QLoRA),
``tools`` and ``environment_factory`` carry over; a value with no equivalent (a reward model by name, a
``transformers.TrainerCallback``, ``optimizers``, ``rollout_func``, ``reward_processing_classes``) is
refused with the config's refusals, in one :class:`~grpo_engine.trl.errors.TRLSettingError`.

Prompts are rendered as TRL renders them (:class:`~grpo_engine.trl.template.TRLTemplate`); the learning rate
follows TRL's schedule (``transformers.get_scheduler`` with TRL's warm-up rule) in place of the native one;
``use_vllm`` builds the native vLLM sampler on a policy loaded here; ``log_completions`` adds
:class:`~grpo_engine.trl.completions.CompletionLog`. ``train(resume_from_checkpoint=True | path)`` rebuilds
the native trainer with ``resume_from`` (the native exact resume); ``save_model`` writes the policy (the
adapter under LoRA) and the tokenizer with ``save_pretrained``, as TRL's does (``evaluate``,
``log_metrics``, ``save_metrics`` and ``save_state`` too); ``push_to_hub`` (and ``args.push_to_hub``) writes
the hub layout to ``output_dir`` and uploads it (:mod:`grpo_engine.trl.hub`). ``native`` is the native
trainer, for everything else.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import json
import logging
import os
import re
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from grpo_engine.callbacks import Callback, HeldOutEval, TrainerState
from grpo_engine.data.errors import DataError
from grpo_engine.data.records import to_prompts
from grpo_engine.models import load_model
from grpo_engine.rewards.compose import WeightedSum
from grpo_engine.rewards.function import FunctionReward
from grpo_engine.sampling.vllm import VLLMSampler
from grpo_engine.sampling.vllm_server import VLLMServerSampler
from grpo_engine.trainer import GRPOTrainer as NativeTrainer
from grpo_engine.trl.completions import CompletionLog
from grpo_engine.trl.config import GRPOConfig
from grpo_engine.trl.errors import Problem, problem
from grpo_engine.trl.hub import model_card, push_folder
from grpo_engine.trl.mapping import NativeRun, Schedule, native_run
from grpo_engine.trl.template import TRLTemplate

__all__ = ["GRPOTrainer", "TrainOutput", "trl_scheduler"]

logger = logging.getLogger(__name__)


class TrainOutput(NamedTuple):
    """What TRL's ``train()`` returns: the step reached, the mean loss, the last step's metrics."""

    global_step: int
    training_loss: float
    metrics: dict[str, float]


class Processes:
    """``trainer.accelerator`` for TRL's scripts: ``is_main_process``, ``process_index``,
    ``num_processes``, ``device``, ``print`` (rank 0) and ``wait_for_everyone``."""

    def __init__(self, world: Any) -> None:
        self.world = world

    @property
    def is_main_process(self) -> bool:
        return self.world.is_main

    @property
    def process_index(self) -> int:
        return self.world.rank

    @property
    def num_processes(self) -> int:
        return self.world.size

    @property
    def device(self) -> torch.device:
        return self.world.device

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.world.is_main:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        self.world.barrier()


class GRPOTrainer:
    """TRL's ``GRPOTrainer``, run by the native trainer (module docstring).

    Example:
        >>> # from grpo_engine.trl import GRPOConfig, GRPOTrainer
        >>> # trainer = GRPOTrainer(model="Qwen/Qwen2-0.5B-Instruct", reward_funcs=reward_len,
        >>> #                       args=GRPOConfig(output_dir="out"), train_dataset=dataset)
        >>> # trainer.train()
    """

    def __init__(self, model: str | Path | nn.Module, reward_funcs: Any = None,
                 args: GRPOConfig | None = None, train_dataset: Any = None, eval_dataset: Any = None,
                 processing_class: Any = None,
                 reward_processing_classes: Any = None, callbacks: Sequence[Any] | None = None,
                 optimizers: tuple[Any, Any] = (None, None), quantization_config: Any = None,
                 peft_config: Any = None, tools: Sequence[Callable] | None = None, rollout_func: Any = None,
                 environment_factory: Any = None) -> None:
        if args is None:
            name = model if isinstance(model, (str, Path)) else getattr(model.config, "_name_or_path", "m")
            args = GRPOConfig(f"{str(name).rstrip('/').split('/')[-1]}-GRPO")
        env_reward = _environment_reward(environment_factory)
        if env_reward is not None and reward_funcs is None:  # the environment owns the reward, as in TRL
            reward_funcs = []
        found = _argument_problems(args, reward_funcs, train_dataset, eval_dataset, reward_processing_classes,
                                   callbacks, optimizers, quantization_config, rollout_func)
        if isinstance(environment_factory, dict):
            found.append(problem("environment_factory", sorted(environment_factory), "one environment "
                                 "factory serves every prompt here (TRL's dict picks one per prompt)",
                                 "one factory whose environment's reset() reads the prompt's columns"))
        self.args = args
        self.run: NativeRun = native_run(args, num_prompts=_length(train_dataset),
                                         context_tokens=_context(model), device_bf16=_bf16_device(),
                                         lora=peft_config, quantization=quantization_config,
                                         model_dtype=_dtype_of(model), problems=found)
        for note in self.run.notes:
            logger.warning(note)
        if args.run_name and "wandb" in args.report_to:
            os.environ.setdefault("WANDB_NAME", str(args.run_name))
        if processing_class is not None and processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token  # as TRL does
        held_out = ([HeldOutEval(to_prompts(eval_dataset, name="eval_dataset"),
                                 every_steps=self.run.eval_every_steps)]
                    if self.run.eval_every_steps is not None else [])
        logged = ([CompletionLog(self.run.config.log_every_steps, args.output_dir,
                                 args.num_completions_to_print)] if args.log_completions else [])
        rewards = _rewards(reward_funcs, args.reward_weights) + (env_reward or [])
        self.build = dict(model=model, rewards=rewards,
                          prompts=train_dataset, tokenizer=processing_class,
                          callbacks=[*(callbacks or []), *held_out, *logged],
                          tools=tuple(tools or ()), environment_factory=environment_factory)
        self.eval_dataset = eval_dataset
        try:
            self.native = build_native(self.run, self.build, resume_from=None)
        except DataError as error:
            if "max_prompt_tokens" not in str(error):
                raise
            raise DataError(f"{error}. With TRL's entry prompts are never cut, and the limit is the model's "
                            f"context less max_completion_length={args.max_completion_length} "
                            f"({self.run.config.max_prompt_tokens} tokens): shorten those prompts or lower "
                            "max_completion_length") from error

    @property
    def model(self) -> nn.Module:
        """The policy being trained (a ``PeftModel`` under ``peft_config``)."""
        return self.native.model

    @property
    def processing_class(self) -> Any:
        """The tokenizer."""
        return self.native.tokenizer

    @property
    def accelerator(self) -> Processes:
        """What TRL's scripts ask of ``trainer.accelerator``: this process's place, and ``print``."""
        return Processes(self.native.world)

    @property
    def hub_model_id(self) -> str:
        """The repository ``push_to_hub`` uploads to."""
        return self.args.hub_model_id or Path(self.args.output_dir).resolve().name

    def end(self) -> None:
        """TRL's end of a run (trackers finished, process group destroyed): here ``train()`` already ended
        its logging backends, and the process group ends with the process."""

    @property
    def state(self) -> TrainerState:
        """The run's counters (``global_step``, ``max_steps``, ...)."""
        return self.native.state

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> TrainOutput:
        """Runs the training; ``resume_from_checkpoint``: True (the newest ``checkpoint-N`` in
        ``output_dir``) or a checkpoint folder continues that run exactly."""
        if kwargs:
            raise TypeError(f"train() got unexpected keyword arguments {sorted(kwargs)}; it takes "
                            "resume_from_checkpoint (True or a checkpoint folder)")
        if resume_from_checkpoint:
            where = "latest" if resume_from_checkpoint is True else resume_from_checkpoint
            model = self.build["model"]
            model = model if isinstance(model, (str, Path)) else _source(self.native)  # a name loads afresh
            build = {**self.build, "model": model, "tokenizer": self.native.tokenizer}
            self.native = None  # the first trainer's model and reference go before the resumed one loads
            gc.collect()
            self.native = build_native(self.run, build, resume_from=where)
        try:
            history = self.native.train()
        except FileExistsError as error:  # TRL writes over a used output_dir; the native trainer refuses
            raise FileExistsError(f"{error}. With TRL's entry: trainer.train(resume_from_checkpoint=True) "
                                  "continues that run") from error
        if self.args.push_to_hub:  # TRL pushes at each save (hub_strategy 'every_save'): here, the last
            self.push_to_hub(commit_message="End of training")
        losses = [m["loss"] for m in history if "loss" in m]
        return TrainOutput(self.native.state.step, sum(losses) / max(1, len(losses)),
                           dict(history[-1]) if history else {})

    def save_model(self, output_dir: str | None = None) -> Path:
        """Writes the policy (the adapter under LoRA) and the tokenizer to ``output_dir`` (default: the
        config's), with ``save_pretrained``; rank 0 writes. With ``push_to_hub``, pushes, as TRL's does."""
        folder = save_pretrained(self.native, Path(output_dir or self.args.output_dir))
        if self.args.push_to_hub:
            self.push_to_hub(commit_message="Model save")
        return folder

    def evaluate(self, eval_dataset: Any = None) -> dict[str, float]:
        """Greedy pass@1 of the policy on ``eval_dataset`` (default: the trainer's), scored by the first
        reward (``HeldOutEval``'s measure, not TRL's sampled eval loss): ``{"eval/pass@1": ...}``."""
        data = eval_dataset if eval_dataset is not None else self.eval_dataset
        if data is None:
            raise ValueError("evaluate() needs an eval_dataset: pass GRPOTrainer(..., eval_dataset=...) or "
                             "trainer.evaluate(eval_dataset)")
        return self.native.evaluate(to_prompts(data, name="eval_dataset"))

    def log_metrics(self, split: str, metrics: dict[str, Any]) -> None:
        """Logs ``metrics`` of ``split`` (``"train"``, ``"eval"``), one per line, as TRL's Trainer does."""
        if self.native.world.is_main:
            for name, value in sorted(metrics.items()):
                logger.info("%s %s = %s", split, name, value)

    def save_metrics(self, split: str, metrics: dict[str, Any], combined: bool = True) -> Path:
        """Writes ``metrics`` to ``output_dir/{split}_results.json`` (and ``all_results.json``)."""
        folder = Path(self.args.output_dir)
        if self.native.world.is_main:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{split}_results.json").write_text(json.dumps(metrics, indent=2, default=float))
            if combined:
                whole = folder / "all_results.json"
                every = json.loads(whole.read_text()) if whole.is_file() else {}
                whole.write_text(json.dumps({**every, **metrics}, indent=2, default=float))
        return folder / f"{split}_results.json"

    def save_state(self) -> Path:
        """Writes the run's counters to ``output_dir/trainer_state.json`` (a checkpoint keeps the whole
        state for a resume)."""
        path = Path(self.args.output_dir) / "trainer_state.json"
        if self.native.world.is_main:
            path.parent.mkdir(parents=True, exist_ok=True)
            state = {**self.native.state.state_dict(), "global_step": self.native.state.step,
                     "max_steps": self.native.state.max_steps, "log_history": self.native.history}
            path.write_text(json.dumps(state, indent=2, default=float))
        return path

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, **kwargs: Any) -> Any:
        """Writes the hub layout to ``output_dir`` (the policy, the tokenizer, a model card; the
        checkpoints stay out), then uploads it to ``hub_model_id`` (default: the ``output_dir`` folder's
        name). ``kwargs``: TRL's model-card fields (``dataset_name`` is written; the rest are accepted).

        Raises:
            HubPushError: the push failed (offline, no token): the reason, and the saved folder kept.
        """
        if not self.native.world.is_main:
            return None
        folder = save_pretrained(self.native, Path(self.args.output_dir))
        base = self.build["model"]
        base = str(base) if isinstance(base, (str, Path)) else getattr(base.config, "_name_or_path", "model")
        (folder / "README.md").write_text(model_card(base, kwargs.get("dataset_name")))
        return push_folder(folder, repo_id=self.hub_model_id,
                           token=token or self.args.hub_token, private=self.args.hub_private_repo,
                           revision=revision or self.args.hub_revision,
                           commit_message=commit_message or "End of training")


def save_pretrained(native: NativeTrainer, folder: Path) -> Path:
    """The policy (the adapter under LoRA) and the tokenizer in ``folder``, written by rank 0."""
    if native.world.is_main:
        folder.mkdir(parents=True, exist_ok=True)
        native.model.save_pretrained(folder)
        native.tokenizer.save_pretrained(folder)
    return folder


def build_native(run: NativeRun, build: dict[str, Any], *, resume_from: Any) -> NativeTrainer:
    """The native trainer of ``run`` and ``build`` (the model and the trainer's other arguments), with TRL's
    learning-rate schedule (continued at a resumed step)."""
    model, tokenizer, sampler = build["model"], build["tokenizer"], None
    if run.vllm is not None:
        model, tokenizer, sampler = vllm_sampler(run, model, tokenizer)
    native = NativeTrainer(model, trl_rewards(run, build["rewards"]), build["prompts"], run.config,
                           run.memory, tokenizer=tokenizer, sampler=sampler, template=TRLTemplate(),
                           advantage=run.advantage, loss=run.loss,
                           callbacks=[*build["callbacks"], *run.callbacks],
                           resume_from=resume_from, tools=build["tools"],
                           environment_factory=build["environment_factory"])
    native.scheduler = trl_scheduler(native.optimizer, run.schedule, start=native.state.step)
    return native


def trl_rewards(run: NativeRun, rewards: list[Any]) -> list[Any] | WeightedSum:
    """The trainer's rewards as ``run`` combines them: as they are (summed by weight), or under TRL's
    ``normalize_then_sum`` each z-scored in its group first, ``WeightedSum(normalize="each", eps=1e-4)``."""
    if run.reward_normalize == "after_sum":
        return rewards
    return WeightedSum(rewards, normalize=run.reward_normalize, eps=1e-4)


def vllm_sampler(run: NativeRun, model: Any, tokenizer: Any) -> tuple[nn.Module, Any, Any]:
    """TRL's ``use_vllm``: the policy loaded here (the trainer then adds LoRA to it in place), its tokenizer,
    and the vLLM sampler on them (docs/vllm.md); vLLM loads the base weights from ``model``'s folder."""
    name = model if isinstance(model, (str, Path)) else getattr(model.config, "_name_or_path", "")
    if isinstance(model, (str, Path)):
        model, loaded = load_model(model, plan=run.memory)
        tokenizer = tokenizer if tokenizer is not None else loaded
    cfg = run.config
    shared = dict(template=TRLTemplate(), max_prompt_tokens=cfg.max_prompt_tokens,
                  max_completion_tokens=cfg.max_completion_tokens, temperature=cfg.temperature,
                  top_p=cfg.top_p, top_k=cfg.top_k)
    if run.vllm.mode == "server":
        return model, tokenizer, VLLMServerSampler(model, tokenizer, **run.vllm.settings, **shared)
    return model, tokenizer, VLLMSampler(model, tokenizer, engine_model=str(name), **run.vllm.settings,
                                         **shared)


def trl_scheduler(optimizer: torch.optim.Optimizer, schedule: Schedule, *, start: int = 0) -> Any:
    """``transformers.get_scheduler`` of ``schedule``, advanced ``start`` steps (a resumed run)."""
    from transformers import get_scheduler

    scheduler = get_scheduler(schedule.name, optimizer, num_warmup_steps=schedule.warmup_steps,
                              num_training_steps=schedule.total_steps,
                              scheduler_specific_kwargs=schedule.kwargs or None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
        for _ in range(start):
            scheduler.step()
    return scheduler


def _source(native: NativeTrainer) -> nn.Module:
    """The model object to build a resumed trainer from: the adapters the plan added are taken out again
    (the checkpoint brings them back); the weights are the checkpoint's."""
    model = native.model
    return model.unload() if native.memory.lora is not None else model


def _argument_problems(args: GRPOConfig, reward_funcs: Any, train_dataset: Any, eval_dataset: Any,
                       reward_processing_classes: Any, callbacks: Any, optimizers: Any,
                       quantization_config: Any, rollout_func: Any) -> list[Problem]:
    """The trainer's arguments with no equivalent here."""
    del quantization_config  # the plan's (mapping.native_run)
    found = []
    funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    for func in funcs:
        if func is None or isinstance(func, (str, Path, nn.Module)) or not callable(func):
            found.append(problem("reward_funcs", func, "rewards here are functions (or grpo_engine Reward "
                                 "objects); a reward model is not loaded",
                                 "def reward(completions, **kwargs) -> list[float], which may call your "
                                 "reward model"))
    weights = args.reward_weights
    if weights is not None and len(weights) != len(funcs):
        found.append(problem("reward_weights", weights, f"{len(weights)} weights for {len(funcs)} reward "
                             "functions", f"one weight per reward function ({len(funcs)})"))
    if train_dataset is None:
        found.append(problem("train_dataset", None, "GRPO samples its prompts from it", "a datasets.Dataset "
                             "with a 'prompt' column"))
    if isinstance(eval_dataset, dict):
        found.append(problem("eval_dataset", "a dict of datasets", "HeldOutEval evaluates one dataset",
                             "eval_dataset=one datasets.Dataset"))
    if str(args.eval_strategy) != "no" and eval_dataset is None:
        found.append(problem("eval_strategy", str(args.eval_strategy), "evaluation needs an eval_dataset",
                             "pass eval_dataset, or eval_strategy='no'"))
    other = [type(c).__name__ for c in callbacks or [] if not isinstance(c, Callback)]
    if other:
        found.append(problem("callbacks", other, "transformers' TrainerCallback events (on_log, on_evaluate, "
                             "...) are not raised here", "a grpo_engine.callbacks.Callback (on_step_end, "
                             "on_rollout, on_save, ...)"))
    if optimizers is not None and tuple(optimizers) != (None, None):
        found.append(problem("optimizers", optimizers, "the trainer builds its AdamW and TRL's schedule",
                             "optim, learning_rate, lr_scheduler_type, weight_decay, adam_beta1/2"))
    refused = {"reward_processing_classes": (reward_processing_classes, "no reward model is loaded",
                                             "tokenize inside your reward function"),
               "rollout_func": (rollout_func, "rollouts are the sampler's (with tools: several turns)",
                                "tools=[...] / environment_factory=..., or a Sampler on the native trainer")}
    found += [problem(name, value, why, near) for name, (value, why, near) in refused.items()
              if value is not None]
    if args.use_cpu and torch.cuda.is_available():
        found.append(problem("use_cpu", True, "the trainer trains on the GPU it finds",
                             "CUDA_VISIBLE_DEVICES='' in the environment"))
    return found


def _rewards(reward_funcs: Any, weights: list[float] | None) -> list[Any]:
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if weights is None:
        return funcs
    return [FunctionReward(f, weight=w) for f, w in zip(funcs, weights, strict=True)]


def _environment_reward(factory: Any) -> list[FunctionReward] | None:
    """TRL's ``get_reward``: an environment whose class defines it scores its own rollout, as one more reward
    named after the class, weight 1 (a rollout of another class gets None); an ``async`` one is awaited.
    None when there is no such method (the class is probed with one instance when the factory is a
    function, as TRL does)."""
    if factory is None or isinstance(factory, dict):
        return None
    cls = factory if isinstance(factory, type) else type(factory())
    method = getattr(cls, "get_reward", None)
    if not callable(method):
        return None

    def own(env: Any) -> Any:
        return asyncio.run(env.get_reward()) if inspect.iscoroutinefunction(method) else env.get_reward()

    def reward(environments: list[Any], **kwargs: Any) -> list[Any]:
        return [own(env) if type(env) is cls else None for env in environments]

    reward.__name__ = reward.__qualname__ = cls.__name__
    return [FunctionReward(reward, weight=1.0)]


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:  # a stream
        return None


def _context(model: Any) -> int | None:
    """The model's context (``max_position_embeddings``), read from its config (None when unknown)."""
    config = getattr(model, "config", None)
    if config is None:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(str(model))
        except (OSError, ValueError):
            return None
    return getattr(config, "max_position_embeddings", None)


def _dtype_of(model: Any) -> str | None:
    """The dtype of a model object's weights (``"bfloat16"``, ...), None for a name or folder."""
    if isinstance(model, (str, Path)):
        return None
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def _bf16_device() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
