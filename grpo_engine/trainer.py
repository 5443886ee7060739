"""GRPOTrainer: assembles the components and runs the six-stage GRPO step.

    1. sample a group of completions per prompt (Sampler; a GroupFilter may drop groups; with tools, turns)
    2. score them, with a per-reward breakdown, and each group's uncertainty (rewards, EntropyEstimator)
    3. old / reference log-probs without gradient, only when needed, then the reward transforms (a KL penalty)
    4. advantages                                    (AdvantageFn)
    5. micro-batched loss and backward, normalised by step-global counts (GRPOLoss; grpo_engine.gradients)
    6. optimizer step and metrics; callbacks (evaluation, controllers, user code) run after

No algorithm math lives here: the trainer moves records between components, logs the metrics and calls
the callbacks (grpo_engine.callbacks). The parallelism strategy (grpo_engine.distributed) is chosen when the
trainer is built and applied around the loop; one process is data parallel with one rank. Every counter of
a run lives in ``TrainerState``; ``state_dict()`` is what a checkpoint keeps.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from grpo_engine import checkpoint, export, guards
from grpo_engine.advantages import GroupNormalized
from grpo_engine.callbacks import Callback, CallbackList, TrainerControl, TrainerState
from grpo_engine.config import GRPOConfig, advance_clock, lr_factor, run_finished
from grpo_engine.data.checks import training_prompts
from grpo_engine.data.templates import PromptTemplate
from grpo_engine.distributed import World, parallelism
from grpo_engine.eval import evaluate
from grpo_engine.gradients import GradientPass, OldLogprobs, PolicyGradient
from grpo_engine.logging import MetricsLogger, NullLogger, StageTimer, step_metrics
from grpo_engine.losses.clipped import ClippedSurrogate
from grpo_engine.memory.apply import ReferencePolicy, autocast, build_optimizer, is_peft, trainable_parameters
from grpo_engine.memory.plan import MemoryPlan
from grpo_engine.models import load_policy
from grpo_engine.protocols import (
    AdvantageFn,
    EntropyEstimator,
    GroupFilter,
    GRPOLoss,
    PromptSource,
    RewardFn,
    Sampler,
)
from grpo_engine.report import report_callbacks
from grpo_engine.rewards.compose import WeightedSum
from grpo_engine.rewards.runner import trainer_runner
from grpo_engine.rollout import Rollouts
from grpo_engine.sampling import HFSampler, agreed_config
from grpo_engine.tools.rollout import ToolSampler, with_tools
from grpo_engine.types import Prompt, Rollout, RolloutBatch

__all__ = ["GRPOTrainer"]

Rewards = Sequence[RewardFn | Callable[..., Sequence[float | None]]] | RewardFn | WeightedSum


class GRPOTrainer:
    """Trains a causal LM with GRPO.

    Args:
        model: a local folder / hub id, or an already built transformers causal LM.
        rewards: ``Reward`` objects or plain functions ``fn(prompts, completions, **columns)`` (a score or
            None per completion), combined by their weights, and reward transforms (``KLRewardPenalty``);
            or a ``WeightedSum``. Run with the config's ``reward_timeout_s`` and ``on_reward_error``.
        prompts: ``Prompt`` records (each with its answer in ``target``), a ``datasets.Dataset`` or dicts,
            served by a seeded ``PromptStream``; or a ``PromptSource`` (``InformativeCurriculum``).
        config: numbers and switches of the run.
        memory: how the model is held and trained (LoRA, checkpointing, optimizer, micro-batch, sharding).
        tokenizer: required when ``model`` is a module.
        sampler: a ``Sampler`` (default ``HFSampler``) or a ``GroupFilter`` (``DynamicSampling``) on it.
        tools, environment_factory: TRL's: functions to call, one environment per rollout (docs/tools.md).
        advantage: defaults to ``GroupNormalized()`` (group z-score).
        loss: defaults to ``ClippedSurrogate()`` (PPO clip 0.2, per-sequence mean, no KL).
        entropy: optional per-group uncertainty, passed to the advantage function and callbacks.
        template: renders prompts for the sampler and ``evaluate`` (default: the chat template, if any).
        callbacks: ``Callback`` objects (``HeldOutEval``, ``AdaptiveTemperature``, your own).
        resume_from: ``"latest"`` (the newest checkpoint in ``output_dir``), a checkpoint folder, or a
            ``Resume`` naming safe settings that may differ: continues that run exactly.

    Example:
        >>> # trainer = GRPOTrainer("HuggingFaceTB/SmolLM2-135M-Instruct", [MathAccuracy()], prompts,
        >>> #                       config=GRPOConfig(max_steps=20), memory=MemoryPlan(lora=LoRA()),
        >>> #                       callbacks=[HeldOutEval(test_prompts, every_steps=10)])
        >>> # trainer.train()
    """

    def __init__(self, model: str | Path | nn.Module, rewards: Rewards,
                 prompts: Iterable[Prompt | Mapping[str, Any]] | PromptSource,
                 config: GRPOConfig | None = None, memory: MemoryPlan | None = None, *, tokenizer: Any = None,
                 sampler: Sampler | GroupFilter | None = None, advantage: AdvantageFn | None = None,
                 loss: GRPOLoss | None = None, entropy: EntropyEstimator | None = None,
                 template: PromptTemplate | None = None, callbacks: Sequence[Callback] = (),
                 resume_from: str | Path | checkpoint.Resume | None = None, tools: Sequence[Callable] = (),
                 environment_factory: Callable[[], Any] | None = None) -> None:
        self.config = cfg = agreed_config(sampler, config if config is not None else GRPOConfig())
        self.memory = memory = memory if memory is not None else MemoryPlan()
        self.world = world = World.current()  # this process's rank under torchrun (one process: 0 of 1)
        world.check_prompts_per_step(cfg.prompts_per_step)
        torch.manual_seed(cfg.seed)
        self.state = TrainerState(temperature=cfg.temperature, max_steps=cfg.max_steps,
                                  process_index=world.rank, num_processes=world.size)
        self.model, self.tokenizer = load_policy(model, tokenizer, memory, world, cfg.place_model)
        self._components(rewards, sampler, advantage, loss, entropy, template)
        self.sampler = with_tools(self.sampler, tools, environment_factory, cfg)  # multi-turn, with tools
        self.prompts = training_prompts(
            prompts, self.rewards.check, lambda p: len(self.sampler.prompt_tokens(p)),
            max_prompt_tokens=cfg.max_prompt_tokens, overlong=cfg.overlong_prompts,
            batch_size=cfg.prompts_per_step, seed=cfg.seed)
        needs_reference = self.loss.requires.ref_logprobs or self.rewards.requires.ref_logprobs
        full_reference = needs_reference and memory.lora is None and not is_peft(self.model)
        self.parallel = parallelism(memory, world, filters_groups=self.group_filter is not None,
                                    full_reference=full_reference)
        self.reference = ReferencePolicy(self.model, memory) if needs_reference else None
        self.control, self.history, self.callbacks = TrainerControl(), [], list(callbacks)
        loggers = report_callbacks(cfg.report_to) if world.is_main else []  # last: they see every metric
        self.events = CallbackList([*self.callbacks, *loggers], self, self.state, self.control)
        saved = self._saved_run(resume_from)
        if saved is not None:  # into the whole model, before the strategy shards it
            checkpoint.load_weights(self.model, saved[0])
        self.parallel.prepare(self.model)
        self.optimizer = build_optimizer(self.model, memory, learning_rate=cfg.learning_rate,
            betas=cfg.adam_betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_factor(
            cfg, step, self.state.train_seconds, self.state.planned_steps))  # warm-up, then steps or seconds
        self.gradients = PolicyGradient(self.model, self.loss, memory, self.parallel,
                                        log_entropy=cfg.log_token_entropy)
        self.rollouts = Rollouts(self.sampler, lambda batch: self.rewards(batch, self.reward_runner),
                                 self.entropy, self.parallel, group_size=cfg.group_size,
                                 group_filter=self.group_filter, refill=self.prompts)
        self.events.on_init()
        self.resumed_from = self._restore(*saved) if saved is not None else None

    @property
    def step_count(self) -> int:
        """Optimizer steps done."""
        return self.state.step

    @property
    def train_seconds(self) -> float:
        """Seconds spent in ``step()`` (callbacks excluded): ``max_train_seconds``' clock."""
        return self.state.train_seconds

    @property
    def temperature(self) -> float:
        """The sampling temperature in force (log-probs are computed at it too)."""
        return self.state.temperature

    def set_temperature(self, temperature: float) -> None:
        """Samples (and scores log-probs) at ``temperature`` from the next step on."""
        self.state.temperature = temperature

    # -- the loop --------------------------------------------------------------------------------

    def train(self) -> list[dict[str, float]]:
        """Runs ``config.max_steps`` steps (minus those already done, and stopping at ``max_train_seconds``
        or when a callback sets ``control.should_stop``); returns every step's metrics."""
        cfg, world, state, out = self.config, self.world, self.state, Path(self.config.output_dir)
        used = world.broadcast(checkpoint.used_output_dir(out) if world.is_main and state.step == 0 else None)
        if used:  # rank 0 reads the folder, every rank stops
            raise FileExistsError(used)
        if world.is_main:
            checkpoint.clean_leftovers(out)  # an interrupted save's temporary folders
        self.events.on_train_start()
        logger = NullLogger() if not world.is_main else MetricsLogger(  # rank 0 logs
            out, total_steps=None if cfg.max_train_seconds else cfg.max_steps, progress_bar=cfg.progress_bar,
            initial_step=state.step)
        with logger:
            while not (self.control.should_stop or run_finished(cfg, state)):
                metrics = self.step()
                evaluated = any(key.startswith("eval/") for key in metrics)  # an evaluation is never lost
                logger.log(state.step, metrics, write=state.step % cfg.log_every_steps == 0 or evaluated)
                periodic = cfg.save_every_steps and state.step % cfg.save_every_steps == 0
                if self.control.should_save or periodic:
                    self.save(out / f"checkpoint-{state.step}")
                    if world.is_main:
                        checkpoint.prune_checkpoints(out, cfg.keep_last_checkpoints)
                self.control.should_save = False
        self.save(out / "final")
        self.events.on_train_end()
        return self.history

    def step(self) -> dict[str, float]:
        """One optimizer step (``updates_per_batch`` of them on one rollout batch); returns its metrics."""
        timer, temperature, prompts = StageTimer(), self.state.temperature, self.config.prompts_per_step
        # 1-2. sample a group of completions for each prompt (this rank's share) and score them; the
        #      prompt source and the callbacks hear about every group drawn in the whole step
        with self._autocast():
            rollout = self.rollouts.collect(self.prompts.next_batch(prompts), temperature=temperature,
                                            timer=timer)
        drawn = rollout.whole
        self.prompts.observe(drawn.batch, drawn.rewards, drawn.uncertainty)
        self.events.on_rollout(batch=drawn.batch, rewards=drawn.rewards, uncertainty=drawn.uncertainty)
        rollout = rollout.trained()  # the groups a group filter kept (all of them without one)
        batch = rollout.local.batch
        # 3. old and reference log-probs, only when needed; then the reward transforms that need them
        with timer("logprobs"), self._autocast():
            old, ref = self._no_grad_logprobs(batch)
        transformed = self.rewards.transform(rollout.local.rewards, batch, old_logprobs=old, ref_logprobs=ref)
        rollout = self.parallel.gather_rewards(rollout, transformed)
        # 4. advantages from the whole step (a step whose rewards or advantages are not finite is skipped)
        rewards, uncertainty = rollout.whole.rewards, rollout.whole.uncertainty
        advantages = self.advantage(rewards.total, uncertainty=uncertainty)
        guards.check_advantages(advantages, rewards, type(self.advantage).__name__)
        problem = guards.nonfinite_advantages(rewards, advantages)
        # 5. micro-batched loss and backward, 6. optimizer step (updates_per_batch times on this batch)
        loss_metrics: dict[str, float] = {}
        updated = problem is None and self.gradients.counted_rows(advantages.reshape(-1)).numel() > 0
        with timer("train"):
            if problem is None:
                mine = rollout.local_rows(advantages.reshape(-1))
                loss_metrics, problem = self._updates(batch, mine, old, ref)
        return self._end_step(rollout.whole, loss_metrics, problem, timer, updated=updated)

    def _end_step(self, whole: Rollout, loss_metrics: dict[str, float], problem: str | None,
                  timer: StageTimer, *, updated: bool) -> dict[str, float]:
        """Counts the step (skipped or not), advances the clock and the schedule, and returns the step's
        metrics once the callbacks have seen (and may have added to) them."""
        state, temperature, lr = self.state, self.state.temperature, self.scheduler.get_last_lr()[0]
        guards.count_skipped(state, problem, self.config.max_nonfinite_steps)
        state.step += 1
        seconds = timer.seconds()
        seconds = dict(zip(seconds, self.world.max(seconds.values())))  # the slowest rank's: one clock
        advance_clock(self.config, state, seconds, updated=updated)  # and a calibrated budget's plan
        with warnings.catch_warnings():  # a skipped step calls no optimizer.step(); the schedule advances
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            self.scheduler.step()  # once per step, after the clock, which a time budget's decay reads
        metrics = step_metrics(whole, state, loss=loss_metrics, seconds=seconds, temperature=temperature,
                               lr=lr)
        with self.parallel.whole_weights(needed=bool(self.callbacks)):  # FSDP2: rank 0 may evaluate
            self.events.on_step_end(metrics=metrics)
        metrics, state.temperature = self.parallel.agree(metrics, self.control, state.temperature)
        self.history.append(metrics)
        return metrics

    def evaluate(self, prompts: Sequence[Prompt], *, reward: RewardFn | None = None,
                 max_new_tokens: int | None = None, **options: Any) -> dict[str, float]:
        """The current policy's :func:`evaluate` metrics on ``prompts``: ``{"eval/pass@1": ...}``.

        Uses the trainer's template, ``reward`` (default: the first reward), ``max_new_tokens`` (default:
        ``max_completion_tokens``), its ToolSampler with tools (multi-turn) and ``options``, more keywords."""
        cfg, own = self.config, {"sampler": self.sampler} if isinstance(self.sampler, ToolSampler) else {}
        with self._autocast():
            report = evaluate(self.model, self.tokenizer, prompts, reward or self.rewards.rewards[0],
                              template=self.template, batch_size=cfg.completions_per_step, progress=False,
                              max_new_tokens=max_new_tokens or cfg.max_completion_tokens, **own | options)
        return {f"eval/{name}": value for name, value in report.metrics.items()}

    # -- state and checkpoints -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps besides the weights and the optimizer (the strategy writes those): every
        counter (``TrainerState``), the schedule, the random generators, the prompt source, each callback."""
        return {"trainer": self.state.state_dict(), "scheduler": self.scheduler.state_dict(),
                "rng": checkpoint.rng_states(), "prompts": self.prompts.state_dict(),
                "callbacks": [c.state_dict() for c in self.callbacks]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from :meth:`state_dict`'s output (the random generators last)."""
        if len(state["callbacks"]) != len(self.callbacks):
            raise checkpoint.ResumeError(f"the checkpoint was saved with {len(state['callbacks'])} "
                                         f"callbacks, the trainer has {len(self.callbacks)}; pass the same "
                                         "callbacks in the same order")
        self.scheduler.load_state_dict(state["scheduler"])
        self.prompts.load_state_dict(state["prompts"])
        for callback, saved in zip(self.callbacks, state["callbacks"], strict=True):
            callback.load_state_dict(saved)
        self.state.load_state_dict(state["trainer"])
        checkpoint.set_rng_states(state["rng"])

    def save(self, path: str | Path) -> Path:
        """Saves the policy (the adapter under LoRA), the tokenizer, the config files and the state that
        ``resume_from`` continues from, durably; refuses non-finite weights. Every rank calls it."""
        guards.check_finite_weights(self.model, path, self.world)
        state = self.state_dict()
        summary = checkpoint.summary(state["trainer"], self._description())
        files = {"grpo_config.yaml": self.config.to_yaml(), "memory_plan.yaml": self.memory.to_yaml(),
                 checkpoint.SUMMARY_FILE: json.dumps(summary, indent=1)}
        saved = self.parallel.save(Path(path), self.model, self.tokenizer, self.optimizer, state, files)
        self.events.on_save(path=saved)
        return saved

    def save_merged(self, path: str | Path) -> Path:
        """Saves the policy with its LoRA adapter merged into a copy of the weights, and the tokenizer: a
        plain transformers folder for ``AutoModelForCausalLM`` and serving engines (grpo_engine.export)."""
        return export.save_merged(self.model, self.tokenizer, path)

    def _saved_run(self, resume_from: Any) -> tuple[Path, dict[str, Any]] | None:
        """(folder, saved state) of the checkpoint ``resume_from`` names, once its run matches this one."""
        if resume_from is None:
            return None
        resume = resume_from if isinstance(resume_from, checkpoint.Resume) else checkpoint.Resume(resume_from)
        folder = checkpoint.resolve(self.config.output_dir, resume, self.world)
        return folder, checkpoint.read_checkpoint(folder, self._description(), resume.allow_changes)

    def _restore(self, folder: Path, state: dict[str, Any]) -> Path:
        """Continues the saved run: the optimizer (through the strategy), then :meth:`load_state_dict`;
        drops the metrics logged after the checkpoint."""
        self.parallel.load_optimizer(self.model, self.optimizer, state, folder)
        self.load_state_dict(state)
        if self.world.is_main:
            checkpoint.truncate_metrics(Path(self.config.output_dir) / "metrics.jsonl", self.state.step)
        self.world.barrier()
        return folder

    def _description(self) -> dict[str, Any]:
        parts = dict(loss=self.loss, advantage=self.advantage, rewards=self.rewards, entropy=self.entropy)
        return checkpoint.run_description(self.config, self.memory, parts, self.group_filter or self.sampler,
                                          self.callbacks)

    # -- the stages' helpers -------------------------------------------------------------------

    def _components(self, rewards: Rewards, sampler: Sampler | GroupFilter | None,
                    advantage: AdvantageFn | None, loss: GRPOLoss | None, entropy: EntropyEstimator | None,
                    template: PromptTemplate | None) -> None:
        """The components, with their defaults; the default sampler reports log-probs when one reads them."""
        cfg, memory = self.config, self.memory
        self.rewards = rewards if isinstance(rewards, WeightedSum) else WeightedSum(
            [rewards] if callable(rewards) else list(rewards))  # one reward: TRL's reward_funcs=fn
        self.reward_runner = trainer_runner(self.rewards.runner, cfg, self.state)  # time limit, on error
        self.advantage = advantage if advantage is not None else GroupNormalized()
        self.loss = loss if loss is not None else ClippedSurrogate()
        self.entropy, self.template = entropy, template
        self.group_filter = sampler if isinstance(sampler, GroupFilter) else None
        reads_logprobs = self.loss.requires.sampler_logprobs or (
            entropy is not None and entropy.requires.sampler_logprobs)
        self.sampler: Sampler = sampler if sampler is not None and self.group_filter is None else HFSampler(
            self.model, self.tokenizer, template=template, max_prompt_tokens=cfg.max_prompt_tokens,
            max_completion_tokens=cfg.max_completion_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
            top_k=cfg.top_k, share_prompt=memory.share_prompt, merge_lora=memory.merge_lora_for_sampling,
            decoding=memory.decoding, pack_weights=memory.pack_weights_for_sampling,
            compiled_products=memory.compiled_products_for_sampling, return_logprobs=reads_logprobs,
            compile_step=memory.compile_decoding)
        exact_forward = memory.lora is None or memory.lora.dropout == 0  # no dropout: the sampling policy's
        self.old_logprobs = OldLogprobs.plan(
            updates_per_batch=cfg.updates_per_batch, exact_forward=exact_forward,
            asked_by_loss=self.loss.requires.old_logprobs,
            asked=self.loss.requires.old_logprobs or self.rewards.requires.old_logprobs)

    def _no_grad_logprobs(self, batch: RolloutBatch) -> tuple[Tensor | None, Tensor | None]:
        """(old, reference) [N, C] log-probs, each only when something needs it (``OldLogprobs``)."""
        old = self._logprobs(batch, self.model) if self.old_logprobs.separate_pass else None
        if self.reference is None:
            return old, None
        with self.reference.active() as ref_model:
            return old, self._logprobs(batch, ref_model)

    def _logprobs(self, batch: RolloutBatch, model: nn.Module) -> Tensor:
        """[N, C] log-probs of the batch under ``model``, without gradient."""
        return self.gradients.logprobs(batch, model, self.state.temperature)

    def _updates(self, batch: RolloutBatch, advantages: Tensor, old: Tensor | None, ref: Tensor | None
                 ) -> tuple[dict[str, float], str | None]:
        """``updates_per_batch`` policy updates (gradients, clip, optimizer step); the last one's metrics,
        or why an update could not be applied (the optimizer never sees a non-finite gradient)."""
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        old = old if self.old_logprobs.to_loss else None
        metrics: dict[str, float] = {}
        for update in range(self.config.updates_per_batch):
            record = None
            if self.old_logprobs.recorded and update == 0:  # the later updates' old log-probs
                record = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
            found = self._gradient_pass(batch, advantages, old_logprobs=old, ref_logprobs=ref,
                                        record_logprobs=record)
            grad_norm = self.world.clip_grad_norm(trainable_parameters(self.model), max_norm)
            metrics = {**found.metrics, "grad_norm": grad_norm}
            problem = guards.nonfinite_update(metrics, found.nonfinite_rows)
            if problem is not None:
                self.optimizer.zero_grad(set_to_none=True)
                return {}, problem
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)  # no gradient memory held while the next batch samples
            old = record if record is not None else old
        return metrics, None

    def compute_gradients(self, batch: RolloutBatch, advantages: Tensor, **logprobs: Tensor | None
                          ) -> dict[str, float]:
        """Fills ``.grad`` with the gradient of the step's loss on ``batch`` (``advantages`` [N]) and
        returns the loss metrics; ``old_logprobs``, ``ref_logprobs``, ``record_logprobs``: see
        :class:`~grpo_engine.gradients.PolicyGradient`."""
        return self._gradient_pass(batch, advantages, **logprobs).metrics

    def _gradient_pass(self, batch: RolloutBatch, advantages: Tensor, **logprobs: Tensor | None
                       ) -> GradientPass:
        self.optimizer.zero_grad(set_to_none=True)
        found = self.gradients(batch, advantages, temperature=self.state.temperature,
                               metric_keys=self.state.loss_metric_keys, **logprobs)
        self.state.loss_metric_keys = tuple(found.metrics)  # a later step that trains no row logs them as 0
        return found

    def _autocast(self):
        """Mixed precision: ``torch.autocast`` to ``memory.compute_dtype`` when it differs from ``dtype``."""
        return autocast(self.memory, next(self.model.parameters()).device)
