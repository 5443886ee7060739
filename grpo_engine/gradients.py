"""Stage 5 of a step: the micro-batched loss and backward, normalised by the step-global counts.

The loss's counts (``GRPOLoss.counts``) are taken on the whole step, over every rank. The rows that
count are every row, or only those with a non-zero advantage when the loss allows it
(``Requirements.zero_advantage_rows=False``); the strategy may run more (FSDP2 runs them all). They
are cut into micro-batches of ``micro_batch_size`` completions; each is one forward of the policy
(log-probs, and the token entropy from the same chunked pass), the loss divided by the step's counts,
and one backward. Summing the micro-batch losses gives exactly the gradient of one big batch. A
parameter that no row reached gets a zero ``.grad``: a step that ran no row (every advantage 0) still
takes its optimizer step, as it would had every row run. A pass returns what it found: the loss
metrics summed over micro-batches and ranks, and the rows whose log-probs were not finite (for the
guard's message). The logged ``entropy/token_mean`` is the mean over the tokens of the rows that
count, whatever the strategy runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from grpo_engine.distributed import DataParallel
from grpo_engine.logprobs import completion_logprobs
from grpo_engine.memory.apply import activation_offload, autocast, trainable_parameters
from grpo_engine.memory.plan import MemoryPlan
from grpo_engine.ops.tokens import token_entropy_mean
from grpo_engine.protocols import GRPOLoss, PooledEntropyLoss
from grpo_engine.types import MicroBatch, RolloutBatch
from grpo_engine.vocab_tiled import gradients_into_grad

__all__ = ["GradientPass", "PolicyGradient", "OldLogprobs"]


@dataclass(frozen=True)
class OldLogprobs:
    """Where the sampling policy's log-probs come from, decided once when the trainer is built.

    Attributes:
        separate_pass: a no-grad pass before training (the loss or a reward transform asks for them,
            or ``updates_per_batch > 1`` with LoRA dropout, whose training forward is noisier).
        recorded: ``updates_per_batch > 1`` without a separate pass: the first update's forward,
            before any optimizer step, records them for the later updates.
        to_loss: the loss sees them (``updates_per_batch > 1``, or it asks); else it is on-policy.

    Example:
        >>> OldLogprobs.plan(updates_per_batch=2, exact_forward=True, asked_by_loss=False, asked=False)
        OldLogprobs(separate_pass=False, recorded=True, to_loss=True)
    """

    separate_pass: bool
    recorded: bool
    to_loss: bool

    @staticmethod
    def plan(*, updates_per_batch: int, exact_forward: bool, asked_by_loss: bool, asked: bool) -> OldLogprobs:
        """``exact_forward``: a training forward computes the sampling policy's log-probs exactly (no
        dropout); ``asked_by_loss`` / ``asked``: the loss / anything (loss, reward transforms) asks."""
        several = updates_per_batch > 1
        separate = asked or (several and not exact_forward)
        return OldLogprobs(separate, several and not separate, several or asked_by_loss)


@dataclass(frozen=True)
class GradientPass:
    """What one gradient pass found.

    Attributes:
        metrics: the step's loss and loss metrics (summed over micro-batches and ranks), every key
            seen so far included (0 where this step had none).
        finite_rows: (rows [n], whether each row's log-probs were finite [n]) of each micro-batch, on
            the device (read only when something went wrong: reading them synchronises).
    """

    metrics: dict[str, float]
    finite_rows: tuple[tuple[Tensor, Tensor], ...] = ()

    def nonfinite_rows(self) -> list[int]:
        """The rows whose log-probs were not finite in the training forward."""
        return [int(r) for rows, finite in self.finite_rows for r in rows[~finite.cpu()].tolist()]


class PolicyGradient:
    """Fills ``.grad`` of the policy's trainable parameters with the gradient of a step's loss.

    Args:
        model: the policy.
        loss: the objective (its ``requires`` decides the inputs and the rows).
        memory: micro-batch size, log-prob chunking, precision and activation offload.
        parallel: the strategy (counts, gradients and metrics summed over ranks; the rows run).
        log_entropy: compute the token entropy for the ``entropy/token_mean`` metric even when the
            loss does not need it.
    """

    def __init__(self, model: nn.Module, loss: GRPOLoss, memory: MemoryPlan, parallel: DataParallel, *,
                 log_entropy: bool) -> None:
        if loss.requires.entropy_pool and not isinstance(loss, PooledEntropyLoss):
            raise ValueError(f"{type(loss).__name__} declares Requirements(entropy_pool=True) but has no "
                             "pooled_entropy(batch) method; implement it "
                             "(grpo_engine.protocols.PooledEntropyLoss)")
        self.model, self.loss, self.memory, self.parallel = model, loss, memory, parallel
        self.with_entropy = loss.requires.entropy or log_entropy
        self.share_prompt = memory.share_prompt and parallel.share_prompt

    def __call__(self, batch: RolloutBatch, advantages: Tensor, *, temperature: float,
                 old_logprobs: Tensor | None = None, ref_logprobs: Tensor | None = None,
                 record_logprobs: Tensor | None = None,
                 metric_keys: Sequence[str] = ("loss",)) -> GradientPass:
        """One pass over ``batch`` (see the module docstring).

        Args:
            batch: the rollout batch (this rank's rows).
            advantages: [N] one advantage per completion.
            temperature: the sampling temperature, at which the log-probs are computed.
            old_logprobs: [N, C] log-probs of the sampling policy, or None (on-policy).
            ref_logprobs: [N, C] reference log-probs, when the loss needs them.
            record_logprobs: an [N, C] float32 CPU tensor, or None; when given, the detached log-probs
                of the rows run are written into it (before the optimizer step: the sampling policy's).
            metric_keys: metric names to report even when no row of the step ran.
        """
        world = self.parallel.world
        num_tokens, num_sequences = (int(c) for c in world.sum(self.loss.counts(batch.loss_mask,
                                                                                 batch.is_truncated)))
        counted = self.counted_rows(advantages, trains=bool(num_tokens and num_sequences))
        counts = torch.zeros(advantages.shape[0], dtype=torch.bool)
        counts[counted] = True
        entropy_tokens = max(1, int(world.sum([batch.loss_mask[counted].sum()])[0]))
        run = self.parallel.rows_to_run(counted, advantages.shape[0]) if counted.numel() else counted
        micro_batches = list(run.split(self.memory.micro_batch_size)) if run.numel() else []
        pooled = self.loss.requires.entropy_pool
        missing = int(world.max([len(micro_batches)])[0]) - len(micro_batches) if pooled else 0
        sums: dict[str, Tensor | float] = dict.fromkeys(metric_keys, 0.0)
        if self.with_entropy:
            sums.setdefault("entropy/token_mean", 0.0)  # over the rows that count
        finite: list[tuple[Tensor, Tensor]] = []
        self.model.train()
        try:
            for idx in micro_batches:
                step = dict(temperature=temperature, num_tokens=num_tokens, num_sequences=num_sequences)
                found, rows_finite = self._micro_step(batch, idx, advantages, old_logprobs, ref_logprobs,
                                                      record_logprobs, counts[idx], entropy_tokens, **step)
                for key, value in found.items():
                    sums[key] = sums.get(key, 0.0) + value
                finite.append((idx, rows_finite))
            # this rank has no i-th micro-batch: it joins the others' pools with nothing
            for _ in range(missing):
                world.cat(torch.zeros(0))
        finally:
            self.model.eval()
        params = trainable_parameters(self.model)
        for p in params:  # no row ran (every advantage 0): the gradient is zero, not absent, so the
            if p.grad is None:  # optimizer steps as if every row had run (AdamW's momentum still moves)
                p.grad = torch.zeros_like(p)
        self.parallel.reduce_gradients(params)
        return GradientPass(self.parallel.summed_metrics(sums), tuple(finite))

    def counted_rows(self, advantages: Tensor, *, trains: bool = True) -> Tensor:
        """The rows that can change the gradient: every row, or those with a non-zero advantage when the
        loss allows it; none when the step's counts are 0."""
        rows = torch.arange(advantages.shape[0])
        if not trains:
            return rows[:0]
        return rows if self.loss.requires.zero_advantage_rows else rows[advantages.cpu() != 0]

    def _micro_step(self, batch: RolloutBatch, idx: Tensor, advantages: Tensor, old: Tensor | None,
                    ref: Tensor | None, record: Tensor | None, counted: Tensor, entropy_tokens: int, *,
                    temperature: float, num_tokens: int,
                    num_sequences: int) -> tuple[dict[str, Tensor], Tensor]:
        """Forward, loss and backward of the rows ``idx``; returns their metric shares and whether each
        row's log-probs are finite [n]. ``counted``: [n] which of the rows count in the entropy metric."""
        inputs = batch.trimmed(idx)  # prompt ids and mask, completion ids and mask, padding columns cut
        mask = _scored(batch, idx, inputs[3])  # the tokens trained on (not the environment's)
        metrics: dict[str, Tensor] = {}
        # forward and loss under autocast (mixed precision), backward outside it; saved tensors to CPU
        # memory if planned; a tiled head's backward adds its weight gradient into .grad itself
        with activation_offload(self.memory), self._autocast(), gradients_into_grad(self.model):
            out = completion_logprobs(  # token entropy comes from the same chunked pass
                self.model, *inputs, temperature=temperature,
                chunk_size=self.memory.logprob_chunk_size, with_entropy=self.with_entropy,
                vocab_tile=self.memory.logprob_vocab_tile, entropy_grad=self.loss.requires.entropy,
                share_prompt=self.share_prompt, score_mask=mask, compiled=self.memory.compile_training,
                keep_logits=True)  # the backward pass follows the loss, before any other logits
            logprobs, entropy = out if self.with_entropy else (out, None)
            if record is not None:
                record[idx, :mask.shape[1]] = logprobs.detach().float().cpu()
            finite = torch.where(mask, logprobs.detach(), 0.0).isfinite().all(1)
            if entropy is not None:
                shown = mask & counted.to(mask.device)[:, None]
                metrics["entropy/token_mean"] = token_entropy_mean(entropy.detach(), shown, entropy_tokens)
            micro = self._micro_batch(batch, idx, mask, advantages, old, ref, entropy)
            if batch.sampler_logprobs is not None:  # how far the sampler's log-probs are from the trainer's
                metrics["mismatch/logprob_abs"] = _mismatch(logprobs, micro, batch.sampler_logprobs[idx],
                                                            mask, num_tokens)
            out = self.loss(logprobs, micro, num_valid_tokens=num_tokens, num_sequences=num_sequences)
        out.loss.backward()
        # summed on the device: one host sync per step, not per micro-batch
        metrics["loss"] = out.loss.detach()
        metrics.update({key: value.detach() for key, value in out.metrics.items()})
        return metrics, finite

    def _micro_batch(self, batch: RolloutBatch, idx: Tensor, mask: Tensor, advantages: Tensor,
                     old: Tensor | None, ref: Tensor | None, entropy: Tensor | None) -> MicroBatch:
        """The loss's view of the rows ``idx`` (columns cut to ``mask``'s width), with what it asked for;
        the entropy pool gathered over the i-th micro-batch of every rank."""
        width, device, requires = mask.shape[1], mask.device, self.loss.requires
        cut = lambda values: values[idx, :width].to(device) if values is not None else None  # noqa: E731
        micro = MicroBatch(completion_mask=mask, advantages=advantages[idx].to(device), old_logprobs=cut(old),
                           ref_logprobs=cut(ref), is_truncated=batch.is_truncated[idx].to(device),
                           entropy=entropy if requires.entropy else None,
                           sampler_logprobs=cut(batch.sampler_logprobs))
        if not requires.entropy_pool:
            return micro
        pool = self.parallel.world.cat(self.loss.pooled_entropy(micro))
        return dataclasses.replace(micro, entropy_pool=pool)

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch, model: nn.Module, temperature: float) -> Tensor:
        """[N, C] log-probs of the batch under ``model`` without gradient, micro-batch by micro-batch."""
        out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
        for idx in torch.arange(batch.num_completions).split(self.memory.micro_batch_size):
            inputs = batch.trimmed(idx)
            out[idx, :inputs[2].shape[1]] = completion_logprobs(
                model, *inputs, temperature=temperature,
                chunk_size=self.memory.logprob_chunk_size, vocab_tile=self.memory.logprob_vocab_tile,
                share_prompt=self.share_prompt, score_mask=_scored(batch, idx, inputs[3])).cpu()
        return out

    def _autocast(self):
        return autocast(self.memory, next(self.model.parameters()).device)


def _scored(batch: RolloutBatch, idx: Tensor, mask: Tensor) -> Tensor:
    """[n, C'] the loss mask of the rows ``idx`` cut to ``mask``'s width: ``mask`` itself when no
    environment wrote into the completions."""
    if batch.env_mask is None:
        return mask
    return mask & ~batch.env_mask[idx, :mask.shape[1]].to(mask.device)


def _mismatch(logprobs: Tensor, micro: MicroBatch, sampler: Tensor, mask: Tensor, num_tokens: int) -> Tensor:
    """This micro-batch's share of the step's mean |log π_old - log π_sampler| over the trained tokens
    (π_old: the recorded old log-probs, or the training pass's own on-policy)."""
    old = micro.old_logprobs if micro.old_logprobs is not None else logprobs.detach()
    gap = (old.float() - sampler[:, :mask.shape[1]].to(old.device).float()).abs()
    return torch.where(mask, gap, torch.zeros_like(gap)).sum() / max(num_tokens, 1)
