"""The processes of a ``torchrun`` launch and the collectives a step needs.

:class:`World` is this process's rank among ``size`` and its device; each collective is a no-op on one
process, so code written against it runs unchanged on one process and on K ranks. Which collective a
step calls, and when, is the parallelism strategy's business (:mod:`grpo_engine.distributed`).
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["World", "is_sharded"]

_BUCKET = 1 << 24  # elements per gradient all-reduce


@dataclass(frozen=True)
class World:
    """The processes of a run: this one's ``rank`` among ``size``, and the device it trains on.

    ``World.current()`` reads what ``torchrun`` set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) and
    starts the process group (NCCL on GPUs, gloo on the CPU) unless the script already did, and ends it at
    exit; without ``torchrun`` it is one process and every collective is a no-op.

    Example:
        >>> world = World()
        >>> world.size, world.is_main, world.share(["a", "b"])
        (1, True, (['a', 'b'], 0))
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
            raise RuntimeError(f"WORLD_SIZE={size} (a torchrun launch) but this torch has no "
                               "torch.distributed; install a torch build with distributed support, or run "
                               "one process")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            torch.cuda.set_device(local)  # "cuda" means this rank's GPU from here on
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
        atexit.register(_destroy_process_group)  # a group left to the interpreter's teardown can abort it
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

    # -- the step's prompts ------------------------------------------------------------------------

    def check_prompts_per_step(self, prompts_per_step: int) -> None:
        """Raises ValueError unless the step's prompts split evenly across the ranks."""
        if prompts_per_step % self.size:
            low = max(self.size, prompts_per_step - prompts_per_step % self.size)
            raise ValueError(f"prompts_per_step={prompts_per_step} does not split across {self.size} "
                             "processes: each rank samples whole groups for an equal share; set "
                             f"prompts_per_step to a multiple of {self.size} (e.g. {low} or "
                             f"{low + self.size})")

    def share(self, items: Sequence[Any]) -> tuple[list[Any], int]:
        """This rank's slice of ``items`` and the index of its first item: the r-th of K near-equal
        slices in rank order (the first ``len % K`` one longer); all of them on one process.

        Example:
            >>> World(rank=1, size=2).share(["a", "b", "c"])
            (['c'], 2)
        """
        sizes = [len(items) // self.size + (r < len(items) % self.size) for r in range(self.size)]
        first = sum(sizes[:self.rank])
        return list(items[first:first + sizes[self.rank]]), first

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


def _destroy_process_group() -> None:
    """Ends the process group this module started, at exit: gloo's threads torn down with the interpreter
    instead can end a finished rank with ``std::terminate`` (SIGABRT; pytorch/pytorch#190489)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def is_sharded(tensor: Tensor) -> bool:
    """Whether ``tensor`` is an FSDP2 shard (a DTensor)."""
    return hasattr(tensor, "to_local") and hasattr(tensor, "full_tensor")
