"""Several processes under ``torchrun``: which rank this is, the collectives a step needs, FSDP2.

Each step every rank draws the same ``prompts_per_step`` prompts from the same seeded source and takes
its slice (rank r the r-th of K), so groups never straddle ranks; it samples, scores and trains its
own rows. Token draws are keyed by the row's place among all ranks' rows (``HFSampler.place``), so K
ranks sample the completions one process would. :meth:`World.gather_step` hands every rank the whole
step's batch, rewards and uncertainty, from which the trainer computes what has a batch-wide meaning
exactly as one process does (advantages, the loss's counts, observations, metrics); gradients are
summed across ranks (each loss is divided by the whole step's counts), so every rank takes the same
optimizer step; step times are the slowest rank's. Rank 0 alone logs, evaluates and writes. Every
rank holds the whole model (data parallel), or a 1/K shard of its decoder (:func:`fully_shard_model`,
FSDP2) gathered whole while sampling (:func:`full_weights`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from grpo_engine.sampling.dynamic import concat_rewards, concat_rollouts
from grpo_engine.types import RewardOutput, RolloutBatch

__all__ = ["World", "fully_shard_model", "full_weights", "is_sharded", "local_value"]

_BUCKET = 1 << 24  # elements per gradient all-reduce


@dataclass(frozen=True)
class World:
    """The processes of a run: this one's ``rank`` among ``size``, and the device it trains on.

    ``World.current()`` reads what ``torchrun`` set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) and
    starts the process group (NCCL on GPUs, gloo on the CPU) unless the script already did; without
    ``torchrun`` it is one process and every collective is a no-op.

    Example:
        >>> world = World()
        >>> world.size, world.is_main, world.shard(["a", "b"])
        (1, True, ['a', 'b'])
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @classmethod
    def current(cls) -> World:
        """This process's place in the ``torchrun`` launch (one process when there is none)."""
        if dist.is_available() and dist.is_initialized():
            local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
            return cls(rank=dist.get_rank(), size=dist.get_world_size(), local_rank=local)
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size <= 1:
            return cls()
        if not dist.is_available():
            raise RuntimeError(f"WORLD_SIZE={size} (a torchrun launch) but this torch has no torch.distributed; "
                               "install a torch build with distributed support, or run one process")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            torch.cuda.set_device(local)  # "cuda" means this rank's GPU from here on
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
        return cls(rank=dist.get_rank(), size=dist.get_world_size(), local_rank=local)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs, evaluates and writes."""
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        """Where this rank's model lives: its GPU (``LOCAL_RANK``) when there is one, else the CPU."""
        return torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")

    def _tensor_device(self) -> torch.device:
        """Where collectives take their tensors: NCCL only reduces GPU tensors."""
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    # -- the step's data ---------------------------------------------------------------------------

    def check_prompts_per_step(self, prompts_per_step: int) -> None:
        """Raises ValueError unless the step's prompts split evenly across the ranks."""
        if prompts_per_step % self.size:
            low = max(self.size, prompts_per_step - prompts_per_step % self.size)
            raise ValueError(f"prompts_per_step={prompts_per_step} does not split across {self.size} processes: each "
                             f"rank samples whole groups for an equal share; set prompts_per_step to a multiple of "
                             f"{self.size} (e.g. {low} or {low + self.size})")

    def shard(self, items: Sequence[Any]) -> list[Any]:
        """This rank's equal slice of ``items`` (all of them on one process)."""
        share = len(items) // self.size
        return list(items[self.rank * share:(self.rank + 1) * share])

    def local_rows(self, values: Tensor, sizes: Sequence[int] | None = None) -> Tensor:
        """This rank's slice of ``values`` along dim 0 (the step's rows, in rank order): the r-th of
        ``sizes`` (every rank's count), or the r-th equal share."""
        sizes = sizes if sizes is not None else [values.shape[0] // self.size] * self.size
        start = sum(sizes[:self.rank])
        return values[start:start + sizes[self.rank]]

    def gather_step(self, batch: RolloutBatch, rewards: RewardOutput, uncertainty: Tensor | None
                    ) -> tuple[RolloutBatch, RewardOutput, Tensor | None]:
        """The whole step on every rank: the ranks' batches, rewards and uncertainties, in rank order."""
        if self.size == 1:
            return batch, rewards, uncertainty
        parts = self.gather_objects((_cpu_batch(batch), _cpu_rewards(rewards),
                                     uncertainty.cpu() if uncertainty is not None else None))
        whole_uncertainty = None if uncertainty is None else torch.cat([p[2] for p in parts]).to(uncertainty.device)
        return (concat_rollouts([p[0] for p in parts]), concat_rewards([p[1] for p in parts]), whole_uncertainty)

    def gather_rewards(self, rewards: RewardOutput) -> RewardOutput:
        """Every rank's rewards, concatenated in rank order."""
        if self.size == 1:
            return rewards
        return concat_rewards(self.gather_objects(_cpu_rewards(rewards)))

    # -- reductions --------------------------------------------------------------------------------

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sums over the ranks (float64)."""
        return self._reduce(values, dist.ReduceOp.SUM)

    def max(self, values: Sequence[float]) -> list[float]:
        """Element-wise maxima over the ranks."""
        return self._reduce(values, dist.ReduceOp.MAX)

    def cat(self, values: Tensor) -> Tensor:
        """Every rank's 1-D ``values`` (lengths may differ) concatenated in rank order, in their dtype;
        sent as float64, so a rank with nothing to add passes ``torch.zeros(0)`` of any float dtype."""
        if self.size == 1:
            return values
        device = self._tensor_device()
        sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(self.size)]
        dist.all_gather(sizes, torch.tensor([values.numel()], dtype=torch.long, device=device))
        counts = [int(n) for n in sizes]
        if not max(counts):
            return values.reshape(-1)
        padded = torch.zeros(max(counts), dtype=torch.float64, device=device)
        padded[:values.numel()] = values.reshape(-1).detach().to(device=device, dtype=torch.float64)
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded)
        whole = torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)])
        return whole.to(device=values.device, dtype=values.dtype)

    def _reduce(self, values: Sequence[float], op: Any) -> list[float]:
        if self.size == 1:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._tensor_device())
        dist.all_reduce(t, op=op)
        return t.tolist()

    def sum_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sums ``.grad`` over the ranks in place (a rank that trained no row adds zeros), in buckets of
        about 2^24 elements per dtype (one all-reduce each)."""
        if self.size == 1:
            return
        params = [p for p in params if p.requires_grad and not is_sharded(p)]  # FSDP2 summed its shards
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        buckets: dict[tuple[torch.dtype, torch.device, int], list[Tensor]] = {}
        filled: dict[tuple[torch.dtype, torch.device], int] = {}
        for p in params:
            kind = (p.grad.dtype, p.grad.device)
            filled[kind] = filled.get(kind, 0) + p.grad.numel()
            buckets.setdefault((*kind, (filled[kind] - 1) // _BUCKET), []).append(p.grad)
        for grads in buckets.values():
            flat = torch.cat([g.reshape(-1) for g in grads]).to(self._tensor_device())
            dist.all_reduce(flat)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def clip_grad_norm(self, params: Sequence[Tensor], max_norm: float) -> float:
        """``torch.nn.utils.clip_grad_norm_`` over every rank's shards too: the norm of the whole gradient
        (float64 sums), and the gradients scaled by ``max_norm / (norm + 1e-6)`` when that is below 1."""
        grads = [p.grad for p in params if p.grad is not None]
        if not any(is_sharded(g) for g in grads):
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        shards = sum(float(g.to_local().double().pow(2).sum()) for g in grads if is_sharded(g))
        whole = sum(float(g.double().pow(2).sum()) for g in grads if not is_sharded(g))
        norm = (self.sum([shards])[0] + whole) ** 0.5
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                (g.to_local() if is_sharded(g) else g).mul_(coef)
        return norm

    def broadcast_parameters(self, params: Iterable[Tensor]) -> None:
        """Copies rank 0's values of ``params`` to every rank (the trained weights start equal)."""
        if self.size == 1:
            return
        for p in params:
            data = p.data.to(self._tensor_device())
            dist.broadcast(data, src=0)
            p.data.copy_(data)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        """Waits for every rank."""
        if self.size > 1:  # NCCL: on this rank's GPU (not whichever it would guess)
            dist.barrier(**({"device_ids": [self.local_rank]} if dist.get_backend() == "nccl" else {}))


# -- FSDP2 ----------------------------------------------------------------------------------------------


def fully_shard_model(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Shards a causal LM over the process group with FSDP2 and returns the sharded units: each decoder
    layer, then the decoder (embeddings, final norm). The lm_head stays whole on every rank (the
    log-prob pass calls it a varying number of times, and every FSDP2 call is a collective), and so
    does an embedding tied to it; their gradients are summed like data parallel's. FSDP2 sums the
    sharded gradients too (no averaging): every rank's loss is already divided by the whole step's counts.

    Raises:
        ValueError: the model has no ``get_decoder()`` with a ``layers`` module list.
        RuntimeError: this torch has no FSDP2 with sum-only gradient reduction.
    """
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError:
        FSDPModule = None  # noqa: N806
    if not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):
        raise RuntimeError(f"sharding='fsdp' needs FSDP2 with FSDPModule.set_force_sum_reduction_for_comms "
                           f"(torch.distributed.fsdp), which torch {torch.__version__} lacks; install a newer "
                           "torch, or use sharding='none' (data parallel)")

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"sharding='fsdp' shards a transformers decoder (model.get_decoder().layers); "
                         f"{type(model).__name__} has none: use sharding='none'")
    head = model.get_output_embeddings()
    tied = {p for p in decoder.parameters() if head is not None and any(p is q for q in head.parameters())}
    units = [*layers, decoder]
    for layer in layers:
        fully_shard(layer)
    fully_shard(decoder, ignored_params=tied or None)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-multiplied sum)
    return units


@contextlib.contextmanager
def full_weights(units: Sequence[torch.nn.Module]) -> Iterator[None]:
    """The whole model on every rank in the block (one all-gather per unit on entry, on every rank), so
    that each rank may run any number of forwards on its own (sampling, evaluation); sharded again
    on exit. Nothing for no units."""
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_reshard_after_forward(True)
            unit.reshard()


def is_sharded(tensor: Tensor) -> bool:
    """Whether ``tensor`` is an FSDP2 shard (a DTensor)."""
    return hasattr(tensor, "to_local") and hasattr(tensor, "full_tensor")


def local_value(value: Any) -> Any:
    """The whole value of a DTensor (a collective: call it on every rank), else the value itself."""
    return value.full_tensor() if is_sharded(value) else value


# -- gathering ---------------------------------------------------------------------------------------


def _cpu_batch(batch: RolloutBatch) -> RolloutBatch:
    """The batch on the CPU, picklable (plain dicts for the read-only views)."""
    tensors = {f.name: getattr(batch, f.name).cpu() for f in dataclasses.fields(batch)
               if isinstance(getattr(batch, f.name), Tensor)}
    return dataclasses.replace(batch, **tensors, metrics=dict(batch.metrics),
                               rewards=_cpu_rewards(batch.rewards) if batch.rewards is not None else None)


def _cpu_rewards(rewards: RewardOutput) -> RewardOutput:
    return RewardOutput(total=rewards.total.cpu(), breakdown={k: v.cpu() for k, v in rewards.breakdown.items()},
                        errors=dict(rewards.errors))  # plain dicts: a mapping proxy does not pickle
