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
from grpo_engine.logprobs import TokenIndex, completion_logprobs, keeps_cache, to_device
from grpo_engine.memory.apply import activation_offload, autocast, trainable_parameters
from grpo_engine.memory.estimate import logprob_granularity
from grpo_engine.memory.plan import MemoryPlan
from grpo_engine.ops.tokens import token_entropy_mean
from grpo_engine.protocols import GRPOLoss, PooledEntropyLoss
from grpo_engine.types import MicroBatch, RolloutBatch
from grpo_engine.vocab_tiled import gradients_into_grad

__all__ = ["GradientPass", "PolicyGradient", "OldLogprobs", "MicroRows"]


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


@dataclass(frozen=True)
class MicroRows:
    """One micro-batch of a pass, laid out by the host before the pass starts (:meth:`split`), so that its
    forward and backward read nothing back from the device: on a GPU the host queues a whole micro-batch
    without waiting. Tensors are on the batch's device unless said otherwise.

    Attributes:
        idx: [n] the rows, into the batch (on the CPU).
        inputs: ``(prompt_ids, prompt_mask, completion_ids, completion_mask)`` of the rows, the columns that
            are padding in every one of them cut (left for prompts, right for completions).
        mask: [n, C'] the tokens scored: the completion's, not an environment's.
        index: where those tokens and the distinct prompts are (``logprobs.TokenIndex``).
        counted: [n] whether each row counts in the entropy metric, or None.
        advantages: [n], or None; old_logprobs, ref_logprobs, sampler_logprobs: [n, C'], or None;
        is_truncated: [n].
    """

    idx: Tensor
    inputs: tuple[Tensor, Tensor, Tensor, Tensor]
    mask: Tensor
    index: TokenIndex
    is_truncated: Tensor
    counted: Tensor | None = None
    advantages: Tensor | None = None
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    sampler_logprobs: Tensor | None = None

    @staticmethod
    def split(batch: RolloutBatch, rows: Tensor, size: int, *, share_prompt: bool,
              advantages: Tensor | None = None, counted: Tensor | None = None, old: Tensor | None = None,
              ref: Tensor | None = None) -> list[MicroRows]:
        """``rows`` [r] (CPU) of ``batch`` in micro-batches of ``size``, each laid out on the host: the masks
        are read back once for all of them (one wait, before any micro-batch runs), and whatever goes to the
        device goes there without waiting (``logprobs.to_device``). ``share_prompt``: a prompt may run once
        for the rows that repeat it. ``advantages`` [N], ``counted`` [N] bool, ``old`` / ``ref`` [N, C]: the
        pass's per-row inputs, sliced per micro-batch."""
        if not rows.numel():
            return []
        prompt_mask, completion_mask = batch.prompt_mask.cpu(), batch.completion_mask.cpu()
        host = _HostView(prompt_ids=batch.prompt_ids.cpu() if share_prompt else None, prompt_mask=prompt_mask,
                         completion_mask=completion_mask,
                         scored=completion_mask & ~batch.env_mask.cpu() if batch.env_mask is not None
                         else completion_mask)
        per_row = dict(advantages=advantages.cpu() if advantages is not None else None, counted=counted)
        return [MicroRows._laid_out(batch, idx, host, per_row, old, ref) for idx in rows.split(size)]

    @staticmethod
    def _laid_out(batch: RolloutBatch, idx: Tensor, host: _HostView, per_row: dict[str, Tensor | None],
                  old: Tensor | None, ref: Tensor | None) -> MicroRows:
        device = batch.completion_ids.device
        first = int(host.prompt_mask[idx].any(dim=0).long().argmax())  # first prompt column any row uses
        width = max(1, int(host.completion_mask[idx].sum(dim=1).max()))
        rows = to_device(idx, device)
        take = lambda values: values.index_select(0, rows) if values is not None else None  # noqa: E731
        cut = lambda v: to_device(v[idx, :width], device) if v is not None else None  # noqa: E731
        keep = host.scored[idx, :width]
        share = host.prompt_ids is not None
        index = TokenIndex.of(host.prompt_ids[idx, first:] if share else None, host.prompt_mask[idx, first:],
                              keep, share=share, device=device)
        inputs = (take(batch.prompt_ids)[:, first:], take(batch.prompt_mask)[:, first:],
                  take(batch.completion_ids)[:, :width], take(batch.completion_mask)[:, :width])
        sampler = take(batch.sampler_logprobs)
        return MicroRows(idx=idx, inputs=inputs, mask=to_device(keep, device), index=index,
                         is_truncated=take(batch.is_truncated),
                         **{key: to_device(values[idx], device) if values is not None else None
                            for key, values in per_row.items()},
                         old_logprobs=cut(old), ref_logprobs=cut(ref),
                         sampler_logprobs=sampler[:, :width] if sampler is not None else None)


@dataclass(frozen=True)
class _HostView:
    """The batch's masks (and its prompt ids where prompts may be shared), read back once for a pass."""

    prompt_ids: Tensor | None
    prompt_mask: Tensor
    completion_mask: Tensor
    scored: Tensor


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
        device = next(model.parameters()).device
        # "auto" log-prob chunks and tiles: small on a CPU; on a GPU the fewest passes whose logits fit a
        # quarter of the memory free now (the model loaded; what the step adds comes from the rest)
        self.logits_bytes = torch.cuda.mem_get_info(device)[0] / 4 if device.type == "cuda" else None

    def granularity(self, tokens: int) -> dict[str, int | None]:
        """``chunk_size`` and ``vocab_tile`` of the log-prob pass over ``tokens`` scored tokens
        (``memory.estimate.logprob_granularity``)."""
        head = self.model.get_output_embeddings()
        chunk, tile = logprob_granularity(head.weight.shape[0], self.memory, tokens,
                                          device=head.weight.device.type, logits_bytes=self.logits_bytes)
        return {"chunk_size": chunk, "vocab_tile": tile}

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
        pooled = self.loss.requires.entropy_pool
        sums: dict[str, Tensor | float] = dict.fromkeys(metric_keys, 0.0)
        if self.with_entropy:
            sums.setdefault("entropy/token_mean", 0.0)  # over the rows that count
        finite: list[tuple[Tensor, Tensor]] = []
        recorded: list[tuple[Tensor, Tensor]] = []
        self.model.train()
        try:
            # everything the host must know is worked out here, once: the micro-batches read nothing back
            micro_batches = MicroRows.split(batch, run, self.memory.micro_batch_size, advantages=advantages,
                                            counted=counts, old=old_logprobs, ref=ref_logprobs,
                                            share_prompt=self.share_prompt and keeps_cache(self.model))
            missing = int(world.max([len(micro_batches)])[0]) - len(micro_batches) if pooled else 0
            for micro in micro_batches:
                found, rows_finite, logprobs = self._micro_step(
                    batch, micro, entropy_tokens, temperature=temperature, num_tokens=num_tokens,
                    num_sequences=num_sequences)
                for key, value in found.items():
                    sums[key] = sums.get(key, 0.0) + value
                finite.append((micro.idx, rows_finite))
                recorded.append((micro.idx, logprobs))
            # this rank has no i-th micro-batch: it joins the others' pools with nothing
            for _ in range(missing):
                world.cat(torch.zeros(0))
        finally:
            self.model.eval()
        if record_logprobs is not None:  # read back once, after every micro-batch ran
            for idx, logprobs in recorded:
                record_logprobs[idx, :logprobs.shape[1]] = logprobs.float().cpu()
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

    def _micro_step(self, batch: RolloutBatch, micro: MicroRows, entropy_tokens: int, *, temperature: float,
                    num_tokens: int, num_sequences: int) -> tuple[dict[str, Tensor], Tensor, Tensor]:
        """Forward, loss and backward of one micro-batch, with no read back to the host (``MicroRows``);
        returns their metric shares, whether each row's log-probs are finite [n] and the detached
        log-probs [n, C'], all on the device."""
        mask = micro.mask  # the tokens trained on (not the environment's)
        metrics: dict[str, Tensor] = {}
        # forward and loss under autocast (mixed precision), backward outside it; saved tensors to CPU
        # memory if planned; a tiled head's backward adds its weight gradient into .grad itself
        with activation_offload(self.memory), self._autocast(), gradients_into_grad(self.model):
            out = completion_logprobs(  # token entropy comes from the same chunked pass
                self.model, *micro.inputs, temperature=temperature, with_entropy=self.with_entropy,
                entropy_grad=self.loss.requires.entropy, score_mask=mask,
                compiled=self.memory.compile_training, index=micro.index,
                **self.granularity(micro.index.kept.numel()),
                keep_logits=True)  # the backward pass follows the loss, before any other logits
            logprobs, entropy = out if self.with_entropy else (out, None)
            finite = torch.where(mask, logprobs.detach(), 0.0).isfinite().all(1)
            if entropy is not None:
                shown = mask & micro.counted[:, None]
                metrics["entropy/token_mean"] = token_entropy_mean(entropy.detach(), shown, entropy_tokens)
            loss_batch = self._micro_batch(micro, entropy)
            if batch.sampler_logprobs is not None:  # how far the sampler's log-probs are from the trainer's
                metrics["mismatch/logprob_abs"] = _mismatch(logprobs, loss_batch, micro.sampler_logprobs,
                                                            mask, num_tokens)
            out = self.loss(logprobs, loss_batch, num_valid_tokens=num_tokens, num_sequences=num_sequences)
        out.loss.backward()
        # summed on the device: one host sync per step, not per micro-batch
        metrics["loss"] = out.loss.detach()
        metrics.update({key: value.detach() for key, value in out.metrics.items()})
        return metrics, finite, logprobs.detach()

    def _micro_batch(self, micro: MicroRows, entropy: Tensor | None) -> MicroBatch:
        """The loss's view of a micro-batch, with what it asked for; the entropy pool gathered over the
        i-th micro-batch of every rank."""
        requires = self.loss.requires
        loss_batch = MicroBatch(completion_mask=micro.mask, advantages=micro.advantages,
                                old_logprobs=micro.old_logprobs, ref_logprobs=micro.ref_logprobs,
                                is_truncated=micro.is_truncated, sampler_logprobs=micro.sampler_logprobs,
                                entropy=entropy if requires.entropy else None)
        if not requires.entropy_pool:
            return loss_batch
        pool = self.parallel.world.cat(self.loss.pooled_entropy(loss_batch))
        return dataclasses.replace(loss_batch, entropy_pool=pool)

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch, model: nn.Module, temperature: float) -> Tensor:
        """[N, C] log-probs of the batch under ``model`` without gradient, micro-batch by micro-batch."""
        out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
        rows = torch.arange(batch.num_completions)
        micro_batches = MicroRows.split(batch, rows, self.memory.micro_batch_size,
                                        share_prompt=self.share_prompt and keeps_cache(model))
        found = [(micro.idx, completion_logprobs(
            model, *micro.inputs, temperature=temperature, score_mask=micro.mask, index=micro.index,
            **self.granularity(micro.index.kept.numel()))) for micro in micro_batches]
        for idx, logprobs in found:  # read back after every micro-batch ran
            out[idx, :logprobs.shape[1]] = logprobs.cpu()
        return out

    def _autocast(self):
        return autocast(self.memory, next(self.model.parameters()).device)


def _mismatch(logprobs: Tensor, micro: MicroBatch, sampler: Tensor, mask: Tensor, num_tokens: int) -> Tensor:
    """This micro-batch's share of the step's mean |log π_old - log π_sampler| over the trained tokens
    (π_old: the recorded old log-probs, or the training pass's own on-policy)."""
    old = micro.old_logprobs if micro.old_logprobs is not None else logprobs.detach()
    gap = (old.float() - sampler[:, :mask.shape[1]].to(old.device).float()).abs()
    return torch.where(mask, gap, torch.zeros_like(gap)).sum() / max(num_tokens, 1)
