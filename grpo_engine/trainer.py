"""GRPOTrainer: assembles the components and runs the six-stage GRPO step.

    1. sample a group of completions per prompt          (Sampler; DynamicSampling repeats 1-2)
    2. score them, with a per-reward breakdown           (WeightedSum of RewardFn)
    3. old / reference log-probs without gradient, only when needed (mu > 1, a KL term or penalty)
    4. per-group uncertainty (optional) and advantages   (EntropyEstimator, AdvantageFn), after an
       optional KL penalty on the rewards                (KLRewardPenalty)
    5. micro-batched loss and backward, normalised by step-global counts (GRPOLoss)
    6. optimizer step, metrics (and every ``eval_every_steps`` greedy pass@1 on eval_prompts), checkpoint

No algorithm math lives here: the trainer moves tensors between components, reduces metrics
and logs them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from grpo_engine.advantages import GroupNormalized, zero_std_fraction
from grpo_engine.checkpoint import save_pretrained_atomic
from grpo_engine.config import GRPOConfig
from grpo_engine.data.stream import PromptStream
from grpo_engine.data.templates import PromptTemplate
from grpo_engine.entropy.control import AdaptiveTemperature, collapsed_fraction
from grpo_engine.entropy.token import token_entropy_mean
from grpo_engine.eval import evaluate
from grpo_engine.logging import MetricsLogger, StageTimer
from grpo_engine.logprobs import completion_logprobs
from grpo_engine.losses import ClippedSurrogate, KLRewardPenalty
from grpo_engine.memory.apply import (
    ReferencePolicy,
    activation_offload,
    autocast,
    build_optimizer,
    prepare_model,
    trainable_parameters,
)
from grpo_engine.memory.plan import MemoryPlan
from grpo_engine.models import load_model
from grpo_engine.protocols import AdvantageFn, EntropyEstimator, GRPOLoss, RewardFn, Sampler
from grpo_engine.rewards import WeightedSum
from grpo_engine.sampling.dynamic import DynamicSampling
from grpo_engine.sampling.hf import HFSampler
from grpo_engine.types import MicroBatch, Prompt, RewardOutput, RolloutBatch

__all__ = ["GRPOTrainer"]


class GRPOTrainer:
    """Trains a causal LM with GRPO.

    Args:
        model: a local folder / hub id, or an already built transformers causal LM.
        rewards: reward functions (combined by their weights), or a ``WeightedSum``.
        train_prompts: the training prompts; each carries its reference answer in ``target``.
        config: numbers and switches of the run.
        memory: how the model is held and trained (LoRA, checkpointing, optimizer, micro-batch).
        tokenizer: required when ``model`` is a module.
        sampler: defaults to ``HFSampler`` on the policy.
        advantage: defaults to ``GroupNormalized()`` (group z-score).
        loss: defaults to ``ClippedSurrogate()`` (PPO clip 0.2, per-sequence mean, no KL).
        entropy: optional per-group uncertainty passed to the advantage function.
        template: renders prompts for the default sampler and the evaluation (chat template when the
            tokenizer has one).
        eval_prompts: held-out prompts; every ``config.eval_every_steps`` steps their greedy pass@1
            (``grpo_engine.eval.evaluate``) is added to that step's metrics as ``eval/pass@1``.
        eval_reward: decides correctness in that evaluation; defaults to the first of ``rewards``
            (put the correctness reward, e.g. ``MathAccuracy``, first).
        dynamic_sampling: DAPO's filter: train only on groups with unequal rewards, topping the
            batch up from fresh prompts (``grpo_engine.sampling.DynamicSampling``).
        kl_penalty: KL to the reference subtracted from each completion's reward before the
            advantages (``grpo_engine.losses.KLRewardPenalty``), instead of a KL term in the loss.
        temperature_control: sets the next step's sampling temperature from the groups' semantic
            entropy and accuracy (``grpo_engine.entropy.AdaptiveTemperature``); needs ``entropy``.
        prompt_source: where prompts come from (default a seeded ``PromptStream``); one with an
            ``update(prompts, accuracy, semantic_entropy)`` method (``InformativeCurriculum``) is told
            how every sampled group did.
        accuracy_reward: the breakdown name whose group mean is "accuracy" for the controller and
            the curriculum (default: the first reward).

    Example:
        >>> # trainer = GRPOTrainer("HuggingFaceTB/SmolLM2-135M-Instruct", [MathAccuracy()], prompts,
        >>> #                       config=GRPOConfig(max_steps=20), memory=MemoryPlan(lora=LoRA()))
        >>> # trainer.train()
    """

    def __init__(
        self,
        model: str | Path | nn.Module,
        rewards: Sequence[RewardFn] | WeightedSum,
        train_prompts: Sequence[Prompt],
        config: GRPOConfig | None = None,
        memory: MemoryPlan | None = None,
        *,
        tokenizer: Any = None,
        sampler: Sampler | None = None,
        advantage: AdvantageFn | None = None,
        loss: GRPOLoss | None = None,
        entropy: EntropyEstimator | None = None,
        template: PromptTemplate | None = None,
        eval_prompts: Sequence[Prompt] | None = None,
        eval_reward: RewardFn | None = None,
        dynamic_sampling: DynamicSampling | None = None,
        kl_penalty: KLRewardPenalty | None = None,
        temperature_control: AdaptiveTemperature | None = None,
        prompt_source: Any = None,
        accuracy_reward: str | None = None,
    ) -> None:
        self.config = config = config if config is not None else GRPOConfig()
        self.memory = memory = memory if memory is not None else MemoryPlan()
        torch.manual_seed(config.seed)
        if isinstance(model, (str, Path)):
            model, loaded_tokenizer = load_model(model, plan=memory)
            tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
        if tokenizer is None:
            raise ValueError("a model object needs its tokenizer: pass GRPOTrainer(model, ..., tokenizer=tokenizer)")
        self.tokenizer = tokenizer
        self.model = prepare_model(model, memory)
        self.rewards = rewards if isinstance(rewards, WeightedSum) else WeightedSum(list(rewards))
        self.prompts = prompt_source if prompt_source is not None else PromptStream(
            list(train_prompts), config.prompts_per_step, seed=config.seed)
        self.sampler = sampler if sampler is not None else HFSampler(
            self.model, tokenizer, template=template, max_prompt_tokens=config.max_prompt_tokens,
            max_completion_tokens=config.max_completion_tokens, temperature=config.temperature,
            top_p=config.top_p, top_k=config.top_k, share_prompt=memory.share_prompt,
            merge_lora=memory.merge_lora_for_sampling, decoding=memory.decoding,
            return_logprobs=any(getattr(c, "requires_sampler_logprobs", False) for c in (loss, entropy)),
        )
        self.advantage = advantage if advantage is not None else GroupNormalized()
        self.loss = loss if loss is not None else ClippedSurrogate()
        self.entropy = entropy
        self.dynamic_sampling = dynamic_sampling
        self.kl_penalty = kl_penalty
        self.temperature = config.temperature  # in force; a temperature controller may change it
        self.temperature_control = temperature_control
        if temperature_control is not None and entropy is None:
            raise ValueError("temperature_control needs per-group semantic entropy: pass "
                             "entropy=SemanticEntropy(normalize=True) as well")
        start = getattr(temperature_control, "temperature", config.temperature)
        if abs(start - config.temperature) > 1e-9:  # else its first update would step from another value
            raise ValueError(f"temperature_control starts at {start} but config.temperature={config.temperature}: "
                             f"pass AdaptiveTemperature(initial={config.temperature}, ...)")
        self.accuracy_reward = accuracy_reward or self.rewards.names[0]
        self.template = template
        self.eval_prompts = list(eval_prompts or [])
        self.eval_reward = eval_reward if eval_reward is not None else self.rewards.rewards[0]
        if config.eval_every_steps and not self.eval_prompts:
            warnings.warn(f"eval_every_steps={config.eval_every_steps} but no eval_prompts were given, so no "
                          "held-out evaluation will run; pass GRPOTrainer(..., eval_prompts=test_prompts)",
                          stacklevel=2)
        needs_reference = self.loss.requires_ref_logprobs or kl_penalty is not None
        self.reference = ReferencePolicy(self.model, memory) if needs_reference else None
        self.optimizer = build_optimizer(
            self.model, memory, learning_rate=config.learning_rate, betas=config.adam_betas,
            eps=config.adam_eps, weight_decay=config.weight_decay,
        )
        self.train_seconds = 0.0  # time spent in step(), less its held-out evaluations: max_train_seconds' clock
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.step_count = 0
        self.history: list[dict[str, float]] = []
        self._metric_keys: tuple[str, ...] = ("loss",)
        self._warned_zero_std = False

    # -- the loop --------------------------------------------------------------------------------

    def train(self) -> list[dict[str, float]]:
        """Runs ``config.max_steps`` steps (minus those already done); returns every step's metrics."""
        cfg = self.config
        out = Path(cfg.output_dir)
        if self.step_count == 0 and (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size:
            raise FileExistsError(f"output_dir={str(out)!r} already holds a run (metrics.jsonl); a new run would "
                                  "mix its metrics with it and replace its saved model. Choose another "
                                  "output_dir, or move the old run away first")
        total = None if cfg.max_train_seconds else cfg.max_steps
        with MetricsLogger(out, total_steps=total, progress_bar=cfg.progress_bar,
                           initial_step=self.step_count) as logger:
            while self.step_count < cfg.max_steps:
                if cfg.max_train_seconds is not None and self.train_seconds >= cfg.max_train_seconds:
                    break
                metrics = self.step()
                write = self.step_count % cfg.log_every_steps == 0 or "eval/pass@1" in metrics  # never lose an eval
                logger.log(self.step_count, metrics, write=write)
                if cfg.save_every_steps and self.step_count % cfg.save_every_steps == 0:
                    self.save(out / f"checkpoint-{self.step_count}")
        self.save(out / "final")
        return self.history

    def step(self) -> dict[str, float]:
        """One optimizer step (``updates_per_batch`` of them on one rollout batch); returns its metrics."""
        cfg, timer = self.config, StageTimer()
        observed: list[tuple[Tensor, Tensor | None]] = []  # (accuracy [b], semantic entropy [b]) of each draw

        def draw(num_prompts: int) -> tuple[RolloutBatch, RewardOutput]:
            # 1. sample a group of completions for each prompt
            with timer("sample"), self._autocast():
                batch = self.sampler.sample(self.prompts.next_batch(num_prompts), group_size=cfg.group_size)
            # 2. score, with the per-reward breakdown
            with timer("reward"):
                rewards = self.rewards(batch)
            self._observe(batch, rewards, observed)
            return batch, rewards

        step_stats: dict[str, float] = {}
        if self.dynamic_sampling is None:
            batch, rewards = draw(cfg.prompts_per_step)
        else:  # stages 1-2 repeat until the batch is full of groups with a learning signal
            batch, rewards, step_stats = self.dynamic_sampling(draw, cfg.prompts_per_step)

        # 3. old and reference log-probs, without gradient and only when needed
        with timer("logprobs"), self._autocast():
            # for mu > 1 the first update's forward pass runs the sampling policy itself and records its
            # log-probs (_update); a separate pass is needed for KL in the reward (before the advantages)
            # and under LoRA dropout (the training forward is then noisier than the sampling policy)
            needs_old = self.kl_penalty is not None or (cfg.updates_per_batch > 1 and not self._can_record_old())
            old = self._logprobs(batch, self.model) if needs_old else None
            ref = None
            if self.reference is not None:
                with self.reference.active() as ref_model:
                    ref = self._logprobs(batch, ref_model)
        if self.kl_penalty is not None:  # KL in the reward: shapes the advantages, not the loss
            penalty = self.kl_penalty(old, ref, batch.completion_mask.cpu()).reshape(rewards.total.shape)
            rewards = RewardOutput(total=rewards.total - penalty.to(rewards.total.device),
                                   breakdown={**rewards.breakdown, "kl_penalty": penalty})
            old = old if cfg.updates_per_batch > 1 else None

        # 4. uncertainty (optional) and advantages
        uncertainty = self.entropy(batch, rewards) if self.entropy is not None else None
        advantages = self.advantage(rewards.total, uncertainty=uncertainty).reshape(-1)  # [N]
        if uncertainty is not None:
            step_stats["entropy/semantic_mean"] = uncertainty.float().mean().item()

        # 5. micro-batched loss and backward, 6. optimizer step (mu times on this batch)
        loss_metrics: dict[str, float] = {}
        lr = self.scheduler.get_last_lr()[0]
        with timer("train"):
            for update in range(cfg.updates_per_batch):
                record = None
                if old is None and update + 1 < cfg.updates_per_batch:  # later updates need the sampling policy's
                    record = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
                loss_metrics = self._update(batch, advantages, old, ref, record=record)
                old = record if record is not None else old

        step_stats["temperature"] = self.temperature
        if self.temperature_control is not None:  # the next step samples at the new temperature
            accuracy = torch.cat([a for a, _ in observed])
            entropy = torch.cat([e for _, e in observed])
            step_stats["entropy/collapsed_fraction"] = collapsed_fraction(
                entropy, accuracy, self.temperature_control.collapse_entropy).item()
            self.temperature = self.temperature_control.update(entropy, accuracy)
            if hasattr(self.sampler, "temperature"):
                self.sampler.temperature = self.temperature

        self.step_count += 1
        held_out: dict[str, float] = {}
        if cfg.eval_every_steps and self.eval_prompts and self.step_count % cfg.eval_every_steps == 0:
            with timer("eval"):
                held_out = self.evaluate()
        seconds = timer.seconds()
        self.train_seconds += seconds["time/step_s"] - seconds.get("time/eval_s", 0.0)
        self.scheduler.step()  # once per step, not per mu update; after the clock, which a time budget's decay reads
        metrics = {**self._batch_metrics(batch, rewards), **step_stats, **loss_metrics, **held_out, **seconds}
        metrics["lr"] = lr
        metrics["tokens/generated_per_s"] = metrics["tokens/generated"] / max(metrics["time/sample_s"], 1e-9)
        self.history.append(metrics)
        return metrics

    def evaluate(self, prompts: Sequence[Prompt] | None = None) -> dict[str, float]:
        """Greedy pass@1 of the current policy on ``prompts`` (default: ``eval_prompts``).

        Uses the trainer's template (else the sampler's), ``eval_max_completion_tokens`` (else
        ``max_completion_tokens``) and ``eval_reward``; returns ``{"eval/pass@1": ...}``.
        """
        cfg = self.config
        prompts = prompts if prompts is not None else self.eval_prompts
        template = self.template if self.template is not None else getattr(self.sampler, "template", None)
        with self._autocast():
            report = evaluate(self.model, self.tokenizer, prompts, self.eval_reward, template=template,
                              max_new_tokens=cfg.eval_max_completion_tokens or cfg.max_completion_tokens,
                              batch_size=cfg.completions_per_step, progress=False)
        return {f"eval/{name}": value for name, value in report.metrics.items()}

    def _update(self, batch: RolloutBatch, advantages: Tensor, old: Tensor | None, ref: Tensor | None,
                record: Tensor | None = None) -> dict[str, float]:
        """One policy update: accumulate the micro-batch gradients, clip, step the optimizer."""
        metrics = self.compute_gradients(batch, advantages, old_logprobs=old, ref_logprobs=ref,
                                         record_logprobs=record)
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(trainable_parameters(self.model), max_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # no gradient memory held while the next batch samples
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
        num_tokens, num_sequences = self._counts(batch)
        pass_entropy = bool(getattr(self.loss, "requires_entropy", False))
        with_entropy = pass_entropy or self.config.log_token_entropy
        sums: dict[str, float] = dict.fromkeys(self._metric_keys, 0.0)
        if with_entropy:
            sums["entropy/token_mean"] = 0.0  # over the rows trained (rows skipped for advantage 0 are not run)
        no_rows = torch.zeros(0, dtype=torch.long)
        try:
            rows = self._rows_to_train(advantages) if num_sequences and num_tokens else no_rows
            trained_tokens = max(1, int(batch.completion_mask[rows].sum()))
            for idx in rows.split(self.memory.micro_batch_size) if rows.numel() else ():
                pid, pmask, cid, cmask = batch.trimmed(idx)
                # forward and loss under autocast (mixed precision), backward outside it
                with activation_offload(self.memory), self._autocast():  # saved tensors to CPU memory, if planned
                    out = completion_logprobs(  # token entropy comes from the same chunked pass
                        self.model, pid, pmask, cid, cmask, temperature=self.temperature,
                        chunk_size=self.memory.logprob_chunk_size, with_entropy=with_entropy,
                        vocab_tile=self.memory.logprob_vocab_tile, entropy_grad=pass_entropy,
                        share_prompt=self.memory.share_prompt)
                    logprobs, entropy = out if with_entropy else (out, None)
                    if record_logprobs is not None:
                        record_logprobs[idx, :cid.shape[1]] = logprobs.detach().float().cpu()
                    if entropy is not None:
                        sums["entropy/token_mean"] += token_entropy_mean(entropy.detach(), cmask, trained_tokens)
                    width, dev = cid.shape[1], logprobs.device
                    micro = MicroBatch(
                        completion_mask=cmask, advantages=advantages[idx].to(dev),
                        old_logprobs=old_logprobs[idx, :width].to(dev) if old_logprobs is not None else None,
                        ref_logprobs=ref_logprobs[idx, :width].to(dev) if ref_logprobs is not None else None,
                        is_truncated=batch.is_truncated[idx].to(dev), entropy=entropy if pass_entropy else None,
                        sampler_logprobs=(batch.sampler_logprobs[idx, :width].to(dev)
                                          if batch.sampler_logprobs is not None else None),
                    )
                    out = self.loss(logprobs, micro, num_valid_tokens=num_tokens, num_sequences=num_sequences)
                out.loss.backward()
                sums["loss"] += out.loss.detach()  # summed on the device: one host sync per step, not per micro-batch
                for key, value in out.metrics.items():
                    sums[key] = sums.get(key, 0.0) + value.detach()
        finally:
            self.model.eval()
        self._metric_keys = tuple(sums)  # a step that trained no row still logs every key (as 0)
        return {key: float(value) for key, value in sums.items()}

    def _observe(self, batch: RolloutBatch, rewards: RewardOutput, observed: list) -> None:
        """Tells the temperature controller and the curriculum how every sampled group did."""
        update = getattr(self.prompts, "update", None)
        if self.temperature_control is None and update is None:
            return
        accuracy = rewards.breakdown[self.accuracy_reward].float().mean(dim=1)  # [b]
        entropy = self.entropy(batch, rewards) if self.entropy is not None else None  # [b]
        observed.append((accuracy, entropy))
        if update is not None:
            update(batch.prompts, accuracy, entropy)

    def _counts(self, batch: RolloutBatch) -> tuple[int, int]:
        """Step-global (valid tokens, sequences) the loss normalises by; the loss may exclude rows."""
        counts = getattr(self.loss, "counts", None)
        if counts is not None:
            tokens, sequences = counts(batch.completion_mask, batch.is_truncated)
            return int(tokens), int(sequences)
        return int(batch.completion_mask.sum()), batch.num_completions

    def _can_record_old(self) -> bool:
        """Whether a training forward pass computes exactly the sampling policy's log-probs (no dropout)."""
        return self.memory.lora is None or self.memory.lora.dropout == 0

    def _rows_to_train(self, advantages: Tensor) -> Tensor:
        """Rows that can change the gradient: rows with advantage 0 are skipped when the loss says so."""
        rows = torch.arange(advantages.shape[0])
        if getattr(self.loss, "needs_zero_advantage_rows", True):
            return rows
        return rows[advantages != 0]

    @torch.no_grad()
    def _logprobs(self, batch: RolloutBatch, model: nn.Module) -> Tensor:
        """[N, C] log-probs of the batch under ``model``, micro-batch by micro-batch."""
        out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
        for idx in torch.arange(batch.num_completions).split(self.memory.micro_batch_size):
            pid, pmask, cid, cmask = batch.trimmed(idx)
            out[idx, :cid.shape[1]] = completion_logprobs(
                model, pid, pmask, cid, cmask, temperature=self.temperature,
                chunk_size=self.memory.logprob_chunk_size, vocab_tile=self.memory.logprob_vocab_tile,
                share_prompt=self.memory.share_prompt).cpu()
        return out

    def _autocast(self):
        """Mixed precision: ``torch.autocast`` to ``memory.compute_dtype`` when it differs from ``dtype``."""
        return autocast(self.memory, next(self.model.parameters()).device)

    # -- metrics, schedule, saving ----------------------------------------------------------

    def _batch_metrics(self, batch: RolloutBatch, rewards: RewardOutput) -> dict[str, float]:
        lengths = batch.completion_lengths.float()
        total = rewards.total.float()
        metrics = {
            "reward/mean": total.mean().item(),
            "reward/std": total.std().item() if total.numel() > 1 else 0.0,
            "completion_length/mean": lengths.mean().item(),
            "completion_length/max": lengths.max().item(),
            "truncated_fraction": batch.is_truncated.float().mean().item(),
            "zero_std_fraction": zero_std_fraction(total).item(),
            "tokens/generated": lengths.sum().item(),
        }
        for name, scores in rewards.breakdown.items():
            metrics[f"reward/{name}/mean"] = scores.float().mean().item()
            metrics[f"reward/{name}/std"] = scores.float().std().item() if scores.numel() > 1 else 0.0
        if metrics["zero_std_fraction"] == 1.0 and not self._warned_zero_std:
            self._warned_zero_std = True
            warnings.warn(
                f"step {self.step_count}: every group has identical rewards, so every advantage is 0 and this "
                "step does not change the policy. If this persists, make the task easier or the reward denser, "
                "or raise group_size / temperature.", stacklevel=3)
        return metrics

    def _lr_factor(self, step: int) -> float:
        cfg = self.config
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        if cfg.max_train_seconds is not None:  # whichever budget ends first, in train() or a loop over step()
            progress = max(progress, self.train_seconds / cfg.max_train_seconds)
        if cfg.lr_schedule == "linear":
            return max(0.0, 1.0 - progress)
        if cfg.lr_schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    def save(self, path: str | Path) -> Path:
        """Saves the policy (the adapter under LoRA), the tokenizer and the run's config files."""
        extras = {"grpo_config.yaml": self.config.to_yaml(), "memory_plan.yaml": self.memory.to_yaml()}
        return save_pretrained_atomic(self.model, self.tokenizer, path, extras)
