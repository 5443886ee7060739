"""GRPOTrainer: assembles the components and runs the six-stage GRPO step.

    1. sample a group of completions per prompt          (Sampler; a SamplerWrapper may filter groups)
    2. score them, with a per-reward breakdown, and the per-group uncertainty (WeightedSum, EntropyEstimator)
    3. old / reference log-probs without gradient, only when needed, then the reward transforms
       that need them (a KL penalty in the reward)
    4. advantages                                       (AdvantageFn)
    5. micro-batched loss and backward, normalised by step-global counts (GRPOLoss)
    6. optimizer step and metrics; callbacks (evaluation, controllers, user code) run after

No algorithm math lives here: the trainer moves tensors between components, reduces metrics,
logs them and calls the callbacks (grpo_engine.callbacks). Under torchrun each rank samples and trains
its share of the step's prompts and sees the whole step's batch, rewards and metrics
(grpo_engine.distributed); one process is the case of one rank.
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
from grpo_engine.callbacks import Callback, TrainerControl, TrainerState
from grpo_engine.config import GRPOConfig, lr_factor
from grpo_engine.data.checks import check_prompts
from grpo_engine.data.records import to_prompts
from grpo_engine.data.stream import PromptStream
from grpo_engine.data.templates import PromptTemplate
from grpo_engine.distributed import World, full_weights, fully_shard_model, is_sharded
from grpo_engine.eval import evaluate
from grpo_engine.logging import MetricsLogger, NullLogger, StageTimer, rollout_metrics
from grpo_engine.logprobs import completion_logprobs
from grpo_engine.losses import ClippedSurrogate
from grpo_engine.memory.apply import (
    ReferencePolicy,
    activation_offload,
    autocast,
    build_optimizer,
    is_peft,
    prepare_model,
    trainable_parameters,
)
from grpo_engine.memory.plan import MemoryPlan
from grpo_engine.models import load_model
from grpo_engine.ops.tokens import token_entropy_mean
from grpo_engine.protocols import (
    AdvantageFn,
    EntropyEstimator,
    GRPOLoss,
    PromptSource,
    RewardFn,
    Sampler,
    SamplerWrapper,
)
from grpo_engine.report import report_callbacks
from grpo_engine.rewards import WeightedSum
from grpo_engine.sampling.dynamic import select_groups
from grpo_engine.sampling.hf import HFSampler
from grpo_engine.types import MicroBatch, Prompt, RewardOutput, RolloutBatch

__all__ = ["GRPOTrainer"]


class GRPOTrainer:
    """Trains a causal LM with GRPO.

    Args:
        model: a local folder / hub id, or an already built transformers causal LM.
        rewards: rewards (``Reward`` objects, or plain functions ``fn(prompts, completions, **columns)``
            returning a score or None per completion), combined by their weights, and reward transforms
            (e.g. ``KLRewardPenalty``); or a ``WeightedSum``.
        prompts: the training prompts (each carries its reference answer in ``target``): ``Prompt``
            records, a ``datasets.Dataset`` or a list of dicts (``grpo_engine.data.to_prompts``), served
            by a seeded ``PromptStream``; or a ``PromptSource`` (e.g. ``InformativeCurriculum``).
        config: numbers and switches of the run.
        memory: how the model is held and trained (LoRA, checkpointing, optimizer, micro-batch).
        tokenizer: required when ``model`` is a module.
        sampler: a ``Sampler``, or a ``SamplerWrapper`` (``DynamicSampling``) bound to the default
            one; default ``HFSampler`` on the policy.
        advantage: defaults to ``GroupNormalized()`` (group z-score).
        loss: defaults to ``ClippedSurrogate()`` (PPO clip 0.2, per-sequence mean, no KL).
        entropy: optional per-group uncertainty, passed to the advantage function and callbacks.
        template: renders prompts for the default sampler and for ``evaluate`` (chat template when
            the tokenizer has one).
        callbacks: ``Callback`` objects (``HeldOutEval``, ``AdaptiveTemperature``, your own).
        resume_from: ``"latest"`` (the newest checkpoint in ``output_dir``), a checkpoint folder, or a
            ``Resume`` naming safe settings that may differ: continues that run exactly
            (``grpo_engine.checkpoint``).

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
        sampler: Sampler | SamplerWrapper | None = None,
        advantage: AdvantageFn | None = None,
        loss: GRPOLoss | None = None,
        entropy: EntropyEstimator | None = None,
        template: PromptTemplate | None = None,
        callbacks: Sequence[Callback] = (),
        resume_from: str | Path | checkpoint.Resume | None = None,
    ) -> None:
        self.config = config = config if config is not None else GRPOConfig()
        self.memory = memory = memory if memory is not None else MemoryPlan()
        self.world = world = World.current()  # this process's rank under torchrun (one process: rank 0 of 1)
        world.check_prompts_per_step(config.prompts_per_step)
        torch.manual_seed(config.seed)
        if isinstance(model, (str, Path)):
            model, loaded_tokenizer = load_model(model, plan=memory)
            tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
            if memory.quantization is None and world.device.type == "cuda":
                model = model.to(world.device)  # a 4-bit model was loaded onto it already
        elif world.size > 1 and next(model.parameters()).device.type == "cuda":
            model = model.to(world.device)  # each rank's model on its own GPU
        if tokenizer is None:
            raise ValueError("a model object needs its tokenizer: pass GRPOTrainer(model, ..., tokenizer=tokenizer)")
        self.tokenizer, self.template = tokenizer, template
        self.model = prepare_model(model, memory)
        if callable(rewards) and not isinstance(rewards, WeightedSum):
            rewards = [rewards]  # one reward (TRL's reward_funcs=fn)
        self.rewards = (rewards if isinstance(rewards, WeightedSum) else WeightedSum(list(rewards))).configured(
            timeout_s=config.reward_timeout_s, on_error=config.on_reward_error)
        self.advantage = advantage if advantage is not None else GroupNormalized()
        self.loss = loss if loss is not None else ClippedSurrogate()
        self.entropy = entropy
        default = None
        if sampler is None or isinstance(sampler, SamplerWrapper):
            default = HFSampler(
                self.model, tokenizer, template=template, max_prompt_tokens=config.max_prompt_tokens,
                max_completion_tokens=config.max_completion_tokens, temperature=config.temperature,
                top_p=config.top_p, top_k=config.top_k, share_prompt=memory.share_prompt,
                merge_lora=memory.merge_lora_for_sampling, decoding=memory.decoding,
                return_logprobs=self.loss.requires.sampler_logprobs or bool(
                    entropy is not None and entropy.requires_sampler_logprobs))
        self.prompts: PromptSource = self._checked_prompts(prompts, default if default is not None else sampler)
        if isinstance(sampler, SamplerWrapper):
            if world.size > 1 and not getattr(sampler, "data_parallel", False):
                raise ValueError(f"{type(sampler).__name__} does not declare data_parallel = True (its rounds of "
                                 f"sampling must be the same on the {world.size} ranks); run it in one process, or "
                                 "make it take bind(..., world=) and sample the whole step's rounds on every rank")
            sampler = (sampler.bind(default, self.rewards, self.prompts, world=world) if world.size > 1
                       else sampler.bind(default, self.rewards, self.prompts))
        self.sampler: Sampler = sampler if sampler is not None else default
        needs_reference = self.loss.requires.ref_logprobs or self.rewards.requires.ref_logprobs
        sharded = memory.sharding == "fsdp" and world.size > 1
        if sharded:
            _check_shardable(memory, full_reference=needs_reference and memory.lora is None and not is_peft(model),
                             filters_groups=isinstance(sampler, SamplerWrapper))
        self.reference = ReferencePolicy(self.model, memory) if needs_reference else None
        self.callbacks = list(callbacks)
        # after the user's callbacks (they see every metric); rank 0 alone reports
        self._loggers = report_callbacks(config.report_to) if world.is_main else []
        self.state = TrainerState(max_steps=config.max_steps, temperature=config.temperature,
                                  output_dir=config.output_dir, process_index=world.rank, num_processes=world.size)
        self.control = TrainerControl()
        world.broadcast_parameters(trainable_parameters(self.model))  # every rank starts from rank 0's weights
        resume = None if resume_from is None else (
            resume_from if isinstance(resume_from, checkpoint.Resume) else checkpoint.Resume(resume_from))
        folder = checkpoint.resolve(self, resume) if resume is not None else None
        self._units: list[nn.Module] = []  # FSDP2's sharded units (none: every rank holds the whole model)
        if sharded:
            if folder is not None:
                checkpoint.load_weights(self.model, folder)  # into the whole model, before it is sharded
            self._units = fully_shard_model(self.model)
        self.optimizer = build_optimizer(self.model, memory, learning_rate=config.learning_rate,
                                         betas=config.adam_betas, eps=config.adam_eps, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.history: list[dict[str, float]] = []
        self._metric_keys: tuple[str, ...] = ("loss",)
        self._warned_zero_std = False
        self._skipped_in_a_row = 0
        self._bad_logprob_rows: list[tuple[Tensor, Tensor]] = []
        self._event("on_init")
        self.resumed_from = None if resume is None else checkpoint.restore(self, resume, folder,
                                                                           sharded=bool(self._units))

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
        return self.sampler.temperature

    def set_temperature(self, temperature: float) -> None:
        """Samples (and scores log-probs) at ``temperature`` from the next step on."""
        self.sampler.temperature = temperature
        self.state.temperature = temperature

    # -- the loop --------------------------------------------------------------------------------

    def train(self) -> list[dict[str, float]]:
        """Runs ``config.max_steps`` steps (minus those already done, and stopping at ``max_train_seconds``
        or when a callback sets ``control.should_stop``); returns every step's metrics."""
        cfg, world = self.config, self.world
        out = Path(cfg.output_dir)
        used = world.is_main and self.step_count == 0 and (out / "metrics.jsonl").is_file() and bool(
            (out / "metrics.jsonl").stat().st_size)
        if world.broadcast(used):  # rank 0 reads the folder, every rank stops
            raise FileExistsError(f"output_dir={str(out)!r} already holds a run (metrics.jsonl); a new run would "
                                  "mix its metrics with it and replace its saved model. Resume it with "
                                  "GRPOTrainer(..., resume_from='latest') (CLI: --resume), choose another "
                                  "output_dir, or move the old run away first")
        if world.is_main:
            checkpoint.clean_leftovers(out)  # an interrupted save's temporary folders
        total = None if cfg.max_train_seconds else cfg.max_steps
        self._event("on_train_start")
        logger = MetricsLogger(out, total_steps=total, progress_bar=cfg.progress_bar,
                               initial_step=self.step_count) if world.is_main else NullLogger()
        with logger:
            while self.step_count < cfg.max_steps and not self.control.should_stop:
                if cfg.max_train_seconds is not None and self.train_seconds >= cfg.max_train_seconds:
                    break
                metrics = self.step()
                write = self.step_count % cfg.log_every_steps == 0 or any(k.startswith("eval/") for k in metrics)
                logger.log(self.step_count, metrics, write=write)  # an evaluation is never lost
                if self.control.should_save or (cfg.save_every_steps and self.step_count % cfg.save_every_steps == 0):
                    self.save(out / f"checkpoint-{self.step_count}")
                    if world.is_main:
                        checkpoint.prune_checkpoints(out, cfg.keep_last_checkpoints)
                self.control.should_save = False
        self.save(out / "final")
        self._event("on_train_end")
        return self.history

    def step(self) -> dict[str, float]:
        """One optimizer step (``updates_per_batch`` of them on one rollout batch); returns its metrics."""
        cfg, timer, world = self.config, StageTimer(), self.world
        temperature, lr = self.temperature, self.scheduler.get_last_lr()[0]
        # 1. sample a group of completions for each prompt (this rank's share of them)
        with timer("sample"), self._autocast(), full_weights(self._units):  # FSDP2: the whole model to sample
            prompts = self.prompts.next_batch(cfg.prompts_per_step)  # the whole step's, the same on every rank
            if world.size > 1 and hasattr(self.sampler, "place"):  # token draws keyed by the row's place
                self.sampler.place = (world.rank * len(prompts) // world.size, len(prompts))
            batch = self.sampler.sample(world.shard(prompts), group_size=cfg.group_size)
        # 2. score (unless the sampler had to), and the per-group uncertainty; every group drawn is observed
        with timer("reward"):
            rewards = batch.rewards if batch.rewards is not None else self.rewards(batch)
            uncertainty = self.entropy(batch, rewards) if self.entropy is not None else None
        whole, whole_rewards, whole_uncertainty = world.gather_step(batch, rewards, uncertainty)
        self.prompts.observe(whole, whole_rewards, whole_uncertainty)
        self._event("on_rollout", batch=whole, rewards=whole_rewards, uncertainty=whole_uncertainty)
        batch, rewards, _ = _trained_groups(batch, rewards, uncertainty)
        whole, whole_rewards, whole_uncertainty = _trained_groups(whole, whole_rewards, whole_uncertainty)
        sizes = world.gather_objects(batch.num_completions)  # each rank's rows trained (a filter may drop groups)
        # 3. old and reference log-probs, only when needed; then the reward transforms that need them
        with timer("logprobs"), self._autocast():
            old, ref = self._no_grad_logprobs(batch)
        transformed = self.rewards.transform(rewards, batch, old_logprobs=old, ref_logprobs=ref)
        if transformed is not rewards:
            whole_rewards = world.gather_rewards(transformed)
        old = old if cfg.updates_per_batch > 1 or self.loss.requires.old_logprobs else None
        # 4. advantages from the whole step (a step whose rewards or advantages are not finite is skipped)
        advantages = self.advantage(whole_rewards.total, uncertainty=whole_uncertainty)
        if tuple(advantages.shape) != tuple(whole_rewards.total.shape):
            raise ValueError(f"{type(self.advantage).__name__} returned advantages of shape {tuple(advantages.shape)}; "
                             f"an AdvantageFn maps rewards [B, G]={tuple(whole_rewards.total.shape)} to the same shape")
        problem = guards.nonfinite_advantages(whole_rewards, advantages)
        advantages = world.local_rows(advantages.reshape(-1), sizes)  # [N] this rank's rows
        # 5. micro-batched loss and backward, 6. optimizer step (mu times on this batch)
        loss_metrics: dict[str, float] = {}
        with timer("train"):
            try:
                loss_metrics = self._updates(batch, advantages, old, ref) if problem is None else {}
            except guards.NonFiniteStep as error:
                problem = str(error)
        self._count_skipped(problem)
        self.state.step += 1
        seconds = timer.seconds()
        seconds = dict(zip(seconds, world.max(seconds.values())))  # the slowest rank's: one clock for every rank
        self.state.train_seconds += seconds["time/step_s"]
        with warnings.catch_warnings():  # a skipped step calls no optimizer.step(): the schedule still advances
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
            self.scheduler.step()  # once per step, after the clock, which a time budget's decay reads
        metrics = {**self._batch_metrics(whole, whole_rewards), **whole.metrics, **loss_metrics, **seconds,
                   "temperature": temperature, "lr": lr, "skipped_steps": float(self.state.skipped_steps)}
        if whole_uncertainty is not None:
            metrics["entropy/semantic_mean"] = whole_uncertainty.float().mean().item()
        metrics["tokens/generated_per_s"] = metrics["tokens/generated"] / max(metrics["time/sample_s"], 1e-9)
        with full_weights(self._units if self.callbacks else ()):  # FSDP2: rank 0 may evaluate
            self._event("on_step_end", metrics=metrics)
        metrics = self._agree(metrics)
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

    def save(self, path: str | Path) -> Path:
        """Saves the policy (the adapter under LoRA), the tokenizer, the run's config files and the
        trainer state that ``resume_from`` continues from, durably; refuses non-finite weights. Under
        torchrun every rank calls it and rank 0 writes (under FSDP2 each rank helps gather the whole weights
        and writes its own optimizer shard)."""
        bad = [name for name, p in self.model.named_parameters()
               if p.requires_grad and not bool((p.to_local() if is_sharded(p) else p).isfinite().all())]
        count = int(self.world.sum([len(bad)])[0])  # over every rank's shards under FSDP2
        if count:
            first = f" (first: {bad[0]})" if bad else ""
            raise ValueError(f"refusing to save {path}: {count} trained tensors hold NaN or inf{first}; the last "
                             "complete checkpoint stays as it was")
        saved, weights, tmp = Path(path), None, None
        if self._units:  # FSDP2: the whole weights to rank 0; each rank writes its optimizer shard
            weights = checkpoint.gather_weights(self.model)
            tmp = self.world.broadcast(checkpoint.staging_folder(saved) if self.world.is_main else None)
            checkpoint.save_sharded_optimizer(self.model, self.optimizer, tmp / checkpoint.OPTIMIZER_DIR)
        if self.world.is_main:
            state, summary = checkpoint.trainer_state(self, sharded_optimizer=bool(self._units))
            extras = {"grpo_config.yaml": self.config.to_yaml(), "memory_plan.yaml": self.memory.to_yaml(),
                      checkpoint.SUMMARY_FILE: json.dumps(summary, indent=1)}
            saved = checkpoint.save_pretrained_atomic(self.model, self.tokenizer, path, extras,
                                                      {checkpoint.STATE_FILE: state}, state_dict=weights, tmp=tmp)
        self.world.barrier()  # no rank moves on before the checkpoint is complete
        self._event("on_save", path=saved)
        return saved

    def save_merged(self, path: str | Path) -> Path:
        """Saves the policy with its LoRA adapter merged into a copy of the weights, and the tokenizer: a
        plain transformers folder for ``AutoModelForCausalLM`` and serving engines (``grpo_engine.export``)."""
        return export.save_merged(self.model, self.tokenizer, path)

    # -- the stages' helpers -------------------------------------------------------------------

    def _checked_prompts(self, prompts: Sequence[Prompt] | PromptSource, sampler: Any) -> PromptSource:
        """The prompt source, once every training prompt passed ``check_prompts`` (targets the rewards
        can score, duplicates warned, over-long prompts by ``config.overlong_prompts``)."""
        cfg = self.config
        if not isinstance(prompts, PromptSource):
            prompts = to_prompts(prompts, name="prompts")  # a datasets.Dataset, dicts, or Prompt records
        given = list(prompts) if not isinstance(prompts, PromptSource) else list(getattr(prompts, "prompts", ()))
        length = getattr(sampler, "prompt_tokens", None)
        kept = check_prompts(given, self.rewards.check, max_prompt_tokens=cfg.max_prompt_tokens,
                             prompt_length=(lambda p: len(length(p))) if callable(length) else None,
                             overlong=cfg.overlong_prompts)
        if not isinstance(prompts, PromptSource):
            return PromptStream(kept, cfg.prompts_per_step, seed=cfg.seed)
        if len(kept) != len(given):
            raise ValueError(f"overlong_prompts='drop' would drop {len(given) - len(kept)} prompts of the "
                             f"{type(prompts).__name__} given, which cannot lose prompts once built; pass the prompts "
                             "as a list, or filter them before building it")
        return prompts

    def _agree(self, metrics: dict[str, float]) -> dict[str, float]:
        """After the callbacks, every rank holds rank 0's metrics (its evaluation's too) and temperature,
        and stops or saves when any rank's callbacks asked."""
        if self.world.size == 1:
            return metrics
        control = self.control
        asks = self.world.gather_objects((control.should_stop, control.should_save))
        control.should_stop, control.should_save = (any(ask[i] for ask in asks) for i in range(2))
        metrics, temperature = self.world.broadcast((metrics, self.temperature))
        if temperature != self.temperature:
            self.set_temperature(temperature)
        return metrics

    def _count_skipped(self, problem: str | None) -> None:
        """Counts a skipped step, explains it, and stops the run after ``max_nonfinite_steps`` in a row."""
        if problem is None:
            self._skipped_in_a_row = 0
            return
        self.state.skipped_steps += 1
        self._skipped_in_a_row += 1
        warnings.warn(f"step {self.step_count + 1} skipped, weights unchanged: {problem}", stacklevel=3)
        if self._skipped_in_a_row >= self.config.max_nonfinite_steps:
            raise guards.NonFiniteError(
                f"{self._skipped_in_a_row} steps in a row were skipped for non-finite values (the last: {problem}); "
                f"the weights are those after step {self.step_count - self._skipped_in_a_row + 1} and nothing "
                "non-finite was saved: fix the reward or the settings named above, then resume from the last "
                "checkpoint")

    def _event(self, name: str, **kwargs: Any) -> None:
        for callback in (*self.callbacks, *self._loggers):
            getattr(callback, name)(self, self.state, self.control, **kwargs)

    def _no_grad_logprobs(self, batch: RolloutBatch) -> tuple[Tensor | None, Tensor | None]:
        """(old, reference) [N, C] log-probs, each only when something needs it. For mu > 1 the first
        update's forward records the sampling policy's log-probs itself (``_updates``), unless LoRA
        dropout makes the training forward noisier than sampling."""
        mu_old = self.config.updates_per_batch > 1 and not self._can_record_old()
        needs_old = mu_old or self.loss.requires.old_logprobs or self.rewards.requires.old_logprobs
        old = self._logprobs(batch, self.model) if needs_old else None
        ref = None
        if self.reference is not None:
            with self.reference.active() as ref_model:
                ref = self._logprobs(batch, ref_model)
        return old, ref

    def _updates(self, batch: RolloutBatch, advantages: Tensor, old: Tensor | None, ref: Tensor | None
                 ) -> dict[str, float]:
        """``updates_per_batch`` policy updates (gradients, clip, optimizer step); the last one's metrics."""
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        metrics: dict[str, float] = {}
        for update in range(self.config.updates_per_batch):
            record = None
            if old is None and update + 1 < self.config.updates_per_batch:  # later updates need the sampling policy's
                record = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
            metrics = self.compute_gradients(batch, advantages, old_logprobs=old, ref_logprobs=ref,
                                             record_logprobs=record)
            metrics["grad_norm"] = self.world.clip_grad_norm(trainable_parameters(self.model), max_norm)
            problem = guards.nonfinite_update(metrics, self._bad_logprob_rows)
            if problem is not None:  # the optimizer never sees a non-finite gradient
                self.optimizer.zero_grad(set_to_none=True)
                raise guards.NonFiniteStep(problem)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)  # no gradient memory held while the next batch samples
            old = record if record is not None else old
        return metrics

    def compute_gradients(self, batch: RolloutBatch, advantages: Tensor, *, old_logprobs: Tensor | None = None,
                          ref_logprobs: Tensor | None = None, record_logprobs: Tensor | None = None
                          ) -> dict[str, float]:
        """Fills ``.grad`` of the trainable parameters with the gradient of the step's loss.

        The batch is cut into micro-batches of ``memory.micro_batch_size`` completions; each loss is
        normalised by the step-global token and sequence counts, so the accumulated gradient equals
        the gradient of one pass over the whole batch.

        Args:
            batch: the rollout batch.
            advantages: [N] one advantage per completion.
            old_logprobs: [N, C] log-probs of the sampling policy, or None (on-policy).
            ref_logprobs: [N, C] reference log-probs, when the loss needs them.
            record_logprobs: an [N, C] float32 CPU tensor, or None; when given, the detached log-probs
                of the rows trained are written into it (rows skipped for advantage 0 are left as they
                are). Before the optimizer step these are the sampling policy's, which is how
                ``updates_per_batch > 1`` gets its old log-probs without a separate pass.

        Returns:
            The step's loss and loss metrics (summed over micro-batches).
        """
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self._bad_logprob_rows: list[tuple[Tensor, Tensor]] = []  # (rows, non-finite flags): read only on trouble
        world = self.world  # the counts, the gradient and the metrics are the whole step's (every rank's rows)
        num_tokens, num_sequences = (int(c) for c in world.sum(self.loss.counts(batch.completion_mask,
                                                                                 batch.is_truncated)))
        pass_entropy = self.loss.requires.entropy
        with_entropy = pass_entropy or self.config.log_token_entropy
        sums: dict[str, float] = dict.fromkeys(self._metric_keys, 0.0)
        if with_entropy:
            sums["entropy/token_mean"] = 0.0  # over the rows trained (rows skipped for advantage 0 are not run)
        no_rows = torch.zeros(0, dtype=torch.long)
        try:
            rows = self._rows_to_train(advantages) if num_sequences and num_tokens else no_rows
            # the entropy metric's rows: those a run that may skip advantage-0 rows trains (FSDP2 runs them all)
            counted = self.loss.requires.zero_advantage_rows or not self._units
            trained_tokens = max(1, int(world.sum([batch.completion_mask[rows].sum() if counted else
                                                   batch.completion_mask[rows[advantages[rows] != 0]].sum()])[0]))
            micro_batches = rows.split(self.memory.micro_batch_size) if rows.numel() else ()
            gather = world.cat if self.loss.requires.micro_batch_gather else None  # once per micro-batch
            missing = int(world.max([len(micro_batches)])[0]) - len(micro_batches) if gather else 0
            for idx in micro_batches:
                pid, pmask, cid, cmask = batch.trimmed(idx)
                # forward and loss under autocast (mixed precision), backward outside it
                with activation_offload(self.memory), self._autocast():  # saved tensors to CPU memory, if planned
                    out = completion_logprobs(  # token entropy comes from the same chunked pass
                        self.model, pid, pmask, cid, cmask, temperature=self.sampler.temperature,
                        chunk_size=self.memory.logprob_chunk_size, with_entropy=with_entropy,
                        vocab_tile=self.memory.logprob_vocab_tile, entropy_grad=pass_entropy,
                        share_prompt=self._share_prompt)
                    logprobs, entropy = out if with_entropy else (out, None)
                    if record_logprobs is not None:
                        record_logprobs[idx, :cid.shape[1]] = logprobs.detach().float().cpu()
                    self._bad_logprob_rows.append((idx, ~torch.where(cmask, logprobs.detach(), 0.0).isfinite().all(1)))
                    if entropy is not None:
                        shown = cmask if counted else cmask & (advantages[idx] != 0).to(cmask.device)[:, None]
                        sums["entropy/token_mean"] += token_entropy_mean(entropy.detach(), shown, trained_tokens)
                    width, dev = cid.shape[1], logprobs.device
                    micro = MicroBatch(
                        completion_mask=cmask, advantages=advantages[idx].to(dev),
                        old_logprobs=old_logprobs[idx, :width].to(dev) if old_logprobs is not None else None,
                        ref_logprobs=ref_logprobs[idx, :width].to(dev) if ref_logprobs is not None else None,
                        is_truncated=batch.is_truncated[idx].to(dev), entropy=entropy if pass_entropy else None,
                        sampler_logprobs=(batch.sampler_logprobs[idx, :width].to(dev)
                                          if batch.sampler_logprobs is not None else None), gather=gather,
                    )
                    out = self.loss(logprobs, micro, num_valid_tokens=num_tokens, num_sequences=num_sequences)
                out.loss.backward()
                sums["loss"] += out.loss.detach()  # summed on the device: one host sync per step, not per micro-batch
                for key, value in out.metrics.items():
                    sums[key] = sums.get(key, 0.0) + value.detach()
            for _ in range(missing):  # this rank has no i-th micro-batch: it joins the others' gathers with nothing
                world.cat(torch.zeros(0))
        finally:
            self.model.eval()
        world.sum_gradients(trainable_parameters(self.model))
        keys = tuple(dict.fromkeys(key for keys in world.gather_objects(tuple(sums)) for key in keys))
        self._metric_keys = keys  # a step that trained no row still logs every key (as 0)
        return dict(zip(keys, world.sum([float(sums.get(key, 0.0)) for key in keys])))

    @property
    def _share_prompt(self) -> bool:
        """Prompt sharing in the log-prob passes (not under FSDP2: its one or two passes per micro-batch
        would differ between ranks, and every pass is a collective there)."""
        return self.memory.share_prompt and not self._units

    def _can_record_old(self) -> bool:
        """Whether a training forward pass computes exactly the sampling policy's log-probs (no dropout)."""
        return self.memory.lora is None or self.memory.lora.dropout == 0

    def _rows_to_train(self, advantages: Tensor) -> Tensor:
        """Rows that can change the gradient: rows with advantage 0 are skipped when the loss allows it (not
        under FSDP2, where every rank runs as many forward and backward passes as the others)."""
        rows = torch.arange(advantages.shape[0])
        return rows if self.loss.requires.zero_advantage_rows or self._units else rows[advantages != 0]

    @torch.no_grad()
    def _logprobs(self, batch: RolloutBatch, model: nn.Module) -> Tensor:
        """[N, C] log-probs of the batch under ``model``, micro-batch by micro-batch."""
        out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
        for idx in torch.arange(batch.num_completions).split(self.memory.micro_batch_size):
            pid, pmask, cid, cmask = batch.trimmed(idx)
            out[idx, :cid.shape[1]] = completion_logprobs(
                model, pid, pmask, cid, cmask, temperature=self.sampler.temperature,
                chunk_size=self.memory.logprob_chunk_size, vocab_tile=self.memory.logprob_vocab_tile,
                share_prompt=self._share_prompt).cpu()
        return out

    def _autocast(self):
        """Mixed precision: ``torch.autocast`` to ``memory.compute_dtype`` when it differs from ``dtype``."""
        return autocast(self.memory, next(self.model.parameters()).device)

    # -- metrics, schedule ---------------------------------------------------------------------

    def _batch_metrics(self, batch: RolloutBatch, rewards: RewardOutput) -> dict[str, float]:
        metrics = rollout_metrics(batch, rewards)
        if metrics["zero_std_fraction"] == 1.0 and not self._warned_zero_std:
            self._warned_zero_std = True
            warnings.warn(
                f"step {self.step_count}: every group has identical rewards, so every advantage is 0 and this "
                "step does not change the policy. If this persists, make the task easier or the reward denser, "
                "or raise group_size / temperature.", stacklevel=3)
        return metrics

    def _lr_factor(self, step: int) -> float:
        return lr_factor(self.config, step, self.train_seconds)


def _check_shardable(memory: MemoryPlan, *, full_reference: bool, filters_groups: bool) -> None:
    """Raises ValueError for a plan FSDP2 cannot take here, naming it and the fix."""
    problems = []
    if filters_groups:
        problems.append("a sampler that drops groups (DynamicSampling: ranks would train unequal rows, and every "
                        "FSDP2 pass is a collective)")
    if memory.quantization is not None:
        problems.append("a 4-bit base (quantization='nf4')")
    if memory.optimizer != "adamw":
        problems.append(f"optimizer={memory.optimizer!r} (bitsandbytes states are not sharded)")
    if full_reference:
        problems.append("a frozen reference copy (a KL term under full fine-tuning)")
    if problems:
        raise ValueError(f"sharding='fsdp' does not take {' nor '.join(problems)}; use sharding='none', or LoRA with "
                         "optimizer='adamw' and no quantization")


def _trained_groups(batch: RolloutBatch, rewards: RewardOutput, uncertainty: Tensor | None
                    ) -> tuple[RolloutBatch, RewardOutput, Tensor | None]:
    """The groups the sampler marked for training (all of them when it marked none)."""
    if batch.trained_groups is None or bool(batch.trained_groups.all()):
        return batch, rewards, uncertainty
    groups = batch.trained_groups.nonzero().flatten()
    batch, rewards = select_groups(batch, rewards, groups)
    return batch, rewards, uncertainty[groups.to(uncertainty.device)] if uncertainty is not None else None
