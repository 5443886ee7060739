"""GRPOTrainer: assembles the components and runs the six-stage GRPO step.

    1. sample a group of completions per prompt            (Sampler; a GroupFilter may drop groups)
    2. score them, with a per-reward breakdown, and each group's uncertainty (rewards, EntropyEstimator)
    3. old / reference log-probs without gradient, only when needed, then the reward transforms that
       need them (a KL penalty in the reward)
    4. advantages                                           (AdvantageFn)
    5. micro-batched loss and backward, normalised by step-global counts (GRPOLoss, grpo_engine.gradients)
    6. optimizer step and metrics; callbacks (evaluation, controllers, user code) run after

No algorithm math lives here: the trainer moves records between components, logs the metrics and
calls the callbacks (grpo_engine.callbacks). The parallelism strategy (grpo_engine.distributed) is
chosen when the trainer is built and applied around the loop; one process is data parallel with one
rank. Every counter of a run lives in ``TrainerState``; ``state_dict()`` is what a checkpoint keeps.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from grpo_engine import checkpoint, export, guards
from grpo_engine.advantages import GroupNormalized
from grpo_engine.callbacks import Callback, TrainerControl, TrainerState
from grpo_engine.config import GRPOConfig, lr_factor
from grpo_engine.data.checks import training_prompts
from grpo_engine.data.templates import PromptTemplate
from grpo_engine.distributed import World, parallelism, place_model
from grpo_engine.eval import evaluate
from grpo_engine.gradients import GradientPass, PolicyGradient
from grpo_engine.logging import MetricsLogger, NullLogger, StageTimer, rollout_metrics
from grpo_engine.losses import ClippedSurrogate
from grpo_engine.memory.apply import ReferencePolicy, autocast, build_optimizer, is_peft, prepare_model
from grpo_engine.memory.plan import MemoryPlan
from grpo_engine.models import load_model
from grpo_engine.protocols import AdvantageFn, EntropyEstimator, GRPOLoss, GroupFilter, PromptSource, RewardFn, Sampler
from grpo_engine.report import report_callbacks
from grpo_engine.rewards import WeightedSum, trainer_runner
from grpo_engine.rollout import Rollouts
from grpo_engine.sampling.hf import HFSampler
from grpo_engine.types import Prompt, RolloutBatch, Rollout

__all__ = ["GRPOTrainer"]


@dataclass(frozen=True)
class OldLogprobs:
    """Where the sampling policy's log-probs come from, decided once when the trainer is built.

    Attributes:
        separate_pass: a no-grad pass before training (the loss or a reward transform asks for them,
            or ``updates_per_batch > 1`` with LoRA dropout, whose training forward is noisier).
        recorded: ``updates_per_batch > 1`` without a separate pass: the first update's forward,
            before any optimizer step, records them for the later updates.
        to_loss: the loss sees them (``updates_per_batch > 1``, or it asks); else it is on-policy.
    """

    separate_pass: bool
    recorded: bool
    to_loss: bool

    @staticmethod
    def plan(config: GRPOConfig, memory: MemoryPlan, loss: GRPOLoss, rewards: WeightedSum) -> OldLogprobs:
        several = config.updates_per_batch > 1
        exact_forward = memory.lora is None or memory.lora.dropout == 0
        separate = loss.requires.old_logprobs or rewards.requires.old_logprobs or (several and not exact_forward)
        return OldLogprobs(separate, several and not separate, several or loss.requires.old_logprobs)


class GRPOTrainer:
    """Trains a causal LM with GRPO.

    Args:
        model: a local folder / hub id, or an already built transformers causal LM.
        rewards: rewards (``Reward`` objects, or plain functions ``fn(prompts, completions, **columns)``
            returning a score or None per completion), combined by their weights, and reward transforms
            (e.g. ``KLRewardPenalty``); or a ``WeightedSum``. They run with the config's
            ``reward_timeout_s`` and ``on_reward_error`` (a ``RewardRunner``).
        prompts: the training prompts (each carries its reference answer in ``target``): ``Prompt``
            records, a ``datasets.Dataset`` or a list of dicts (``grpo_engine.data.to_prompts``), served
            by a seeded ``PromptStream``; or a ``PromptSource`` (e.g. ``InformativeCurriculum``).
        config: numbers and switches of the run.
        memory: how the model is held and trained (LoRA, checkpointing, optimizer, micro-batch, sharding).
        tokenizer: required when ``model`` is a module.
        sampler: a ``Sampler`` (default ``HFSampler`` on the policy), or a ``GroupFilter``
            (``DynamicSampling``) applied to the default sampler's groups.
        advantage: defaults to ``GroupNormalized()`` (group z-score).
        loss: defaults to ``ClippedSurrogate()`` (PPO clip 0.2, per-sequence mean, no KL).
        entropy: optional per-group uncertainty, passed to the advantage function and callbacks.
        template: renders prompts for the default sampler and for ``evaluate`` (chat template when
            the tokenizer has one).
        callbacks: ``Callback`` objects (``HeldOutEval``, ``AdaptiveTemperature``, your own).
        resume_from: ``"latest"`` (the newest checkpoint in ``output_dir``), a checkpoint folder, or a
            ``Resume`` naming safe settings that may differ: continues that run exactly.

    Example:
        >>> # trainer = GRPOTrainer("HuggingFaceTB/SmolLM2-135M-Instruct", [MathAccuracy()], prompts,
        >>> #                       config=GRPOConfig(max_steps=20), memory=MemoryPlan(lora=LoRA()),
        >>> #                       callbacks=[HeldOutEval(test_prompts, every_steps=10)])
        >>> # trainer.train()
    """

    def __init__(
        self,
        model: str | Path | nn.Module,
        rewards: Sequence[RewardFn | Callable[..., Sequence[float | None]]] | RewardFn | WeightedSum,
        prompts: Iterable[Prompt | Mapping[str, Any]] | PromptSource,
        config: GRPOConfig | None = None,
        memory: MemoryPlan | None = None,
        *,
        tokenizer: Any = None,
        sampler: Sampler | GroupFilter | None = None,
        advantage: AdvantageFn | None = None,
        loss: GRPOLoss | None = None,
        entropy: EntropyEstimator | None = None,
        template: PromptTemplate | None = None,
        callbacks: Sequence[Callback] = (),
        resume_from: str | Path | checkpoint.Resume | None = None,
    ) -> None:
        self.config = config = config if config is not None else GRPOConfig()
        self.memory = memory = memory if memory is not None else MemoryPlan()
        world = World.current()  # this process's rank under torchrun (one process: rank 0 of 1)
        world.check_prompts_per_step(config.prompts_per_step)
        torch.manual_seed(config.seed)
        self.model, self.tokenizer, self.template = *self._policy(model, tokenizer, world), template
        self.rewards = rewards if isinstance(rewards, WeightedSum) else WeightedSum(
            [rewards] if callable(rewards) else list(rewards))  # one reward: TRL's reward_funcs=fn
        self.reward_runner = trainer_runner(self.rewards.runner, config)  # timeout, error policy
        self.advantage = advantage if advantage is not None else GroupNormalized()
        self.loss, self.entropy = loss if loss is not None else ClippedSurrogate(), entropy
        self.group_filter = sampler if isinstance(sampler, GroupFilter) else None
        self.sampler: Sampler = sampler if sampler is not None and self.group_filter is None else self._hf_sampler()
        self.prompts = training_prompts(prompts, self.rewards.check, lambda p: len(self.sampler.prompt_tokens(p)),
                                        max_prompt_tokens=config.max_prompt_tokens, overlong=config.overlong_prompts,
                                        batch_size=config.prompts_per_step, seed=config.seed)
        needs_reference = self.loss.requires.ref_logprobs or self.rewards.requires.ref_logprobs
        self.parallel = parallelism(memory, world, filters_groups=self.group_filter is not None,
                                    full_reference=needs_reference and memory.lora is None and not is_peft(self.model))
        self.reference = ReferencePolicy(self.model, memory) if needs_reference else None
        self.callbacks, self._loggers = list(callbacks), report_callbacks(config.report_to) if world.is_main else []
        self.state = TrainerState(temperature=config.temperature, process_index=world.rank, num_processes=world.size)
        self.control, self.history = TrainerControl(), []
        saved = self._saved_run(resume_from)
        if saved is not None:  # into the whole model, before the strategy shards it
            checkpoint.load_weights(self.model, saved[0])
        self.parallel.prepare(self.model)
        self.optimizer = build_optimizer(self.model, memory, learning_rate=config.learning_rate,
                                         betas=config.adam_betas, eps=config.adam_eps, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.gradients = PolicyGradient(self.model, self.loss, memory, self.parallel,
                                        log_entropy=config.log_token_entropy)
        self.rollouts = Rollouts(self.sampler, lambda batch: self.rewards(batch, self.reward_runner), entropy,
                                 self.parallel, group_size=config.group_size, group_filter=self.group_filter,
                                 refill=self.prompts)
        self.old_logprobs = OldLogprobs.plan(config, memory, self.loss, self.rewards)
        self._event("on_init")
        self.resumed_from = self._restore(*saved) if saved is not None else None

    @property
    def world(self) -> World:
        """This process's place in the launch."""
        return self.parallel.world

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
        cfg, world, out = self.config, self.world, Path(self.config.output_dir)
        used = world.broadcast(checkpoint.used_output_dir(out) if world.is_main and self.state.step == 0 else None)
        if used:  # rank 0 reads the folder, every rank stops
            raise FileExistsError(used)
        if world.is_main:
            checkpoint.clean_leftovers(out)  # an interrupted save's temporary folders
        self._event("on_train_start")
        total = None if cfg.max_train_seconds else cfg.max_steps
        logger = MetricsLogger(out, total_steps=total, progress_bar=cfg.progress_bar,
                               initial_step=self.state.step) if world.is_main else NullLogger()
        with logger:
            while self.state.step < cfg.max_steps and not self.control.should_stop:
                if cfg.max_train_seconds is not None and self.state.train_seconds >= cfg.max_train_seconds:
                    break
                metrics = self.step()
                write = self.state.step % cfg.log_every_steps == 0 or any(k.startswith("eval/") for k in metrics)
                logger.log(self.state.step, metrics, write=write)  # an evaluation is never lost
                if self.control.should_save or (cfg.save_every_steps and self.state.step % cfg.save_every_steps == 0):
                    self.save(out / f"checkpoint-{self.state.step}")
                    if world.is_main:
                        checkpoint.prune_checkpoints(out, cfg.keep_last_checkpoints)
                self.control.should_save = False
        self.save(out / "final")
        self._event("on_train_end")
        return self.history

    def step(self) -> dict[str, float]:
        """One optimizer step (``updates_per_batch`` of them on one rollout batch); returns its metrics."""
        cfg, timer, temperature = self.config, StageTimer(), self.state.temperature
        # 1-2. sample a group of completions for each prompt (this rank's share) and score them; the prompt
        #      source and the callbacks hear about every group drawn in the whole step
        with self._autocast():
            rollout = self.rollouts.collect(self.prompts.next_batch(cfg.prompts_per_step), temperature=temperature,
                                            timer=timer)
        drawn = rollout.whole
        self.prompts.observe(drawn.batch, drawn.rewards, drawn.uncertainty)
        self._event("on_rollout", batch=drawn.batch, rewards=drawn.rewards, uncertainty=drawn.uncertainty)
        rollout = rollout.trained()  # the groups a group filter kept (all of them without one)
        batch = rollout.local.batch
        # 3. old and reference log-probs, only when needed; then the reward transforms that need them
        with timer("logprobs"), self._autocast():
            old, ref = self._no_grad_logprobs(batch)
        transformed = self.rewards.transform(rollout.local.rewards, batch, old_logprobs=old, ref_logprobs=ref)
        rollout = self.parallel.gather_rewards(rollout, transformed)
        # 4. advantages from the whole step (a step whose rewards or advantages are not finite is skipped)
        advantages = self._advantages(rollout.whole)
        problem = guards.nonfinite_advantages(rollout.whole.rewards, advantages)
        # 5. micro-batched loss and backward, 6. optimizer step (updates_per_batch times on this batch)
        loss_metrics: dict[str, float] = {}
        with timer("train"):
            if problem is None:
                loss_metrics, problem = self._updates(batch, rollout.local_rows(advantages.reshape(-1)), old, ref)
        return self._end_step(rollout.whole, loss_metrics, problem, timer, lr=self.scheduler.get_last_lr()[0])

    def _end_step(self, whole: Rollout, loss_metrics: dict[str, float], problem: str | None, timer: StageTimer,
                  *, lr: float) -> dict[str, float]:
        """Counts the step (skipped or not), advances the clock and the schedule, and logs the step's metrics
        after the callbacks have seen (and may add to) them."""
        state, temperature = self.state, self.state.temperature
        guards.count_skipped(state, problem, self.config.max_nonfinite_steps)
        state.step += 1
        seconds = timer.seconds()
        seconds = dict(zip(seconds, self.world.max(seconds.values())))  # the slowest rank's: one clock for all
        state.train_seconds += seconds["time/step_s"]
        with warnings.catch_warnings():  # a skipped step calls no optimizer.step(): the schedule still advances
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
            self.scheduler.step()  # once per step, after the clock, which a time budget's decay reads
        metrics = {**self._batch_metrics(whole), **whole.batch.metrics, **loss_metrics, **seconds,
                   "temperature": temperature, "lr": lr, "skipped_steps": float(state.skipped_steps)}
        if whole.uncertainty is not None:
            metrics["entropy/semantic_mean"] = whole.uncertainty.float().mean().item()
        metrics["tokens/generated_per_s"] = metrics["tokens/generated"] / max(metrics["time/sample_s"], 1e-9)
        with self.parallel.whole_weights(needed=bool(self.callbacks)):  # FSDP2: rank 0 may evaluate
            self._event("on_step_end", metrics=metrics)
        metrics, state.temperature = self.parallel.agree(metrics, self.control, state.temperature)
        self.history.append(metrics)
        return metrics

    def evaluate(self, prompts: Sequence[Prompt], *, reward: RewardFn | None = None,
                 max_new_tokens: int | None = None) -> dict[str, float]:
        """Greedy pass@1 of the current policy on ``prompts``: ``{"eval/pass@1": ...}``.

        Uses the trainer's template (the chat template when none was given), ``reward`` (default:
        the first reward) and ``max_new_tokens`` (default: ``max_completion_tokens``).
        """
        with self._autocast():
            report = evaluate(self.model, self.tokenizer, prompts, reward or self.rewards.rewards[0],
                              template=self.template, batch_size=self.config.completions_per_step, progress=False,
                              max_new_tokens=max_new_tokens or self.config.max_completion_tokens)
        return {f"eval/{name}": value for name, value in report.metrics.items()}

    # -- state and checkpoints -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the run besides the weights and the optimizer (which the parallelism
        strategy writes, whole or sharded): every counter (``TrainerState``), the schedule, the random
        generators, the prompt source and each callback."""
        return {"trainer": self.state.state_dict(), "scheduler": self.scheduler.state_dict(),
                "rng": checkpoint.rng_states(), "prompts": self.prompts.state_dict(),
                "callbacks": [c.state_dict() for c in self.callbacks]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from :meth:`state_dict`'s output (the random generators last)."""
        if len(state["callbacks"]) != len(self.callbacks):
            raise checkpoint.ResumeError(f"the checkpoint was saved with {len(state['callbacks'])} callbacks, the "
                                         f"trainer has {len(self.callbacks)}; pass the same callbacks in the same order")
        self.scheduler.load_state_dict(state["scheduler"])
        self.prompts.load_state_dict(state["prompts"])
        for callback, saved in zip(self.callbacks, state["callbacks"], strict=True):
            callback.load_state_dict(saved)
        self.state.load_state_dict(state["trainer"])
        checkpoint.set_rng_states(state["rng"])

    def save(self, path: str | Path) -> Path:
        """Saves the policy (the adapter under LoRA), the tokenizer, the run's config files and the
        trainer state that ``resume_from`` continues from, durably; refuses non-finite weights. Under
        torchrun every rank calls it and rank 0 writes (under FSDP2 each rank helps gather the whole
        weights and writes its own optimizer shard)."""
        bad = guards.nonfinite_parameters(self.model)
        count = int(self.world.sum([len(bad)])[0])  # over every rank's shards under FSDP2
        if count:
            first = f" (first: {bad[0]})" if bad else ""
            raise ValueError(f"refusing to save {path}: {count} trained tensors hold NaN or inf{first}; the last "
                             "complete checkpoint stays as it was")
        state = self.state_dict()
        files = {"grpo_config.yaml": self.config.to_yaml(), "memory_plan.yaml": self.memory.to_yaml(),
                 checkpoint.SUMMARY_FILE: json.dumps(checkpoint.summary(state["trainer"], self._description()),
                                                     indent=1)}
        saved = self.parallel.save(Path(path), self.model, self.tokenizer, self.optimizer, state, files)
        self._event("on_save", path=saved)
        return saved

    def save_merged(self, path: str | Path) -> Path:
        """Saves the policy with its LoRA adapter merged into a copy of the weights, and the tokenizer: a
        plain transformers folder for ``AutoModelForCausalLM`` and serving engines (``grpo_engine.export``)."""
        return export.save_merged(self.model, self.tokenizer, path)

    def _saved_run(self, resume_from: str | Path | checkpoint.Resume | None) -> tuple[Path, dict[str, Any]] | None:
        """(folder, saved state) of the checkpoint to resume from, once its run matches this one's."""
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
        components = {"loss": self.loss, "advantage": self.advantage, "rewards": self.rewards, "entropy": self.entropy}
        return checkpoint.run_description(self.config, self.memory, components, self.group_filter or self.sampler,
                                          self.callbacks)

    # -- the stages' helpers -------------------------------------------------------------------

    def _policy(self, model: str | Path | nn.Module, tokenizer: Any, world: World) -> tuple[nn.Module, Any]:
        """The policy to train (loaded, placed on this rank's device, prepared by the memory plan) and
        its tokenizer."""
        loaded_here = isinstance(model, (str, Path))
        if loaded_here:
            model, loaded_tokenizer = load_model(model, plan=self.memory)
            tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
        if tokenizer is None:
            raise ValueError("a model object needs its tokenizer: pass GRPOTrainer(model, ..., tokenizer=tokenizer)")
        model = place_model(model, world, loaded_here=loaded_here, quantized=self.memory.quantization is not None)
        return prepare_model(model, self.memory), tokenizer

    def _hf_sampler(self) -> HFSampler:
        """The default sampler: our decoding loop on the policy, with log-probs when a component reads them."""
        cfg, memory, entropy = self.config, self.memory, self.entropy
        wants_logprobs = self.loss.requires.sampler_logprobs or (entropy is not None and
                                                                 entropy.requires.sampler_logprobs)
        return HFSampler(self.model, self.tokenizer, template=self.template, max_prompt_tokens=cfg.max_prompt_tokens,
                         max_completion_tokens=cfg.max_completion_tokens, temperature=cfg.temperature,
                         top_p=cfg.top_p, top_k=cfg.top_k, share_prompt=memory.share_prompt,
                         merge_lora=memory.merge_lora_for_sampling, decoding=memory.decoding,
                         return_logprobs=wants_logprobs)

    def _no_grad_logprobs(self, batch: RolloutBatch) -> tuple[Tensor | None, Tensor | None]:
        """(old, reference) [N, C] log-probs, each only when something needs it (``OldLogprobs``)."""
        old = self._logprobs(batch, self.model) if self.old_logprobs.separate_pass else None
        ref = None
        if self.reference is not None:
            with self.reference.active() as ref_model:
                ref = self._logprobs(batch, ref_model)
        return old, ref

    def _logprobs(self, batch: RolloutBatch, model: nn.Module) -> Tensor:
        """[N, C] log-probs of the batch under ``model``, without gradient."""
        return self.gradients.logprobs(batch, model, self.state.temperature)

    def _advantages(self, whole: Rollout) -> Tensor:
        """[B, G] advantages of the whole step's rewards (and uncertainty)."""
        advantages = self.advantage(whole.rewards.total, uncertainty=whole.uncertainty)
        if tuple(advantages.shape) != tuple(whole.rewards.total.shape):
            raise ValueError(f"{type(self.advantage).__name__} returned advantages of shape {tuple(advantages.shape)};"
                             f" an AdvantageFn maps rewards [B, G]={tuple(whole.rewards.total.shape)} to the same shape")
        return advantages

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
            found = self._gradient_pass(batch, advantages, old_logprobs=old, ref_logprobs=ref, record_logprobs=record)
            metrics = {**found.metrics, "grad_norm": self.world.clip_grad_norm(self.optimizer.param_groups[0]["params"],
                                                                               max_norm)}
            problem = guards.nonfinite_update(metrics, found.nonfinite_rows() if metrics != found.metrics else ())
            if problem is not None:
                self.optimizer.zero_grad(set_to_none=True)
                return {}, problem
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)  # no gradient memory held while the next batch samples
            old = record if record is not None else old
        return metrics, None

    def compute_gradients(self, batch: RolloutBatch, advantages: Tensor, *, old_logprobs: Tensor | None = None,
                          ref_logprobs: Tensor | None = None, record_logprobs: Tensor | None = None
                          ) -> dict[str, float]:
        """Fills ``.grad`` of the trainable parameters with the gradient of the step's loss on ``batch``
        (micro-batched, normalised by the step-global counts: ``grpo_engine.gradients``) and returns the
        step's loss and loss metrics. ``advantages`` [N]; ``old_logprobs`` / ``ref_logprobs`` [N, C] or
        None; ``record_logprobs`` an [N, C] tensor the pass writes the detached log-probs of its rows into."""
        return self._gradient_pass(batch, advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                                   record_logprobs=record_logprobs).metrics

    def _gradient_pass(self, batch: RolloutBatch, advantages: Tensor, *, old_logprobs: Tensor | None,
                       ref_logprobs: Tensor | None, record_logprobs: Tensor | None) -> GradientPass:
        self.optimizer.zero_grad(set_to_none=True)
        found = self.gradients(batch, advantages, temperature=self.state.temperature, old_logprobs=old_logprobs,
                               ref_logprobs=ref_logprobs, record_logprobs=record_logprobs,
                               metric_keys=self.state.loss_metric_keys)
        self.state.loss_metric_keys = tuple(found.metrics)  # a later step that trains no row logs them as 0
        return found

    def _autocast(self):
        """Mixed precision: ``torch.autocast`` to ``memory.compute_dtype`` when it differs from ``dtype``."""
        return autocast(self.memory, next(self.model.parameters()).device)

    def _event(self, name: str, **kwargs: Any) -> None:
        for callback in (*self.callbacks, *self._loggers):
            getattr(callback, name)(self, self.state, self.control, **kwargs)

    def _batch_metrics(self, whole: Rollout) -> dict[str, float]:
        metrics = rollout_metrics(whole.batch, whole.rewards)
        if metrics["zero_std_fraction"] == 1.0 and not self.state.zero_std_warned:
            self.state.zero_std_warned = True
            warnings.warn(
                f"step {self.state.step}: every group has identical rewards, so every advantage is 0 and this "
                "step does not change the policy. If this persists, make the task easier or the reward denser, "
                "or raise group_size / temperature.", stacklevel=3)
        return metrics

    def _lr_factor(self, step: int) -> float:
        return lr_factor(self.config, step, self.state.train_seconds)
