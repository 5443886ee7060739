"""The parallelism strategy, chosen before the loop: one process, data parallel, or FSDP2.

The training loop calls its strategy the same way whatever it is; one process is data parallel with
K = 1, where every collective is a no-op. The rules every rank follows are written here, once:

- Every rank draws the same ``prompts_per_step`` prompts from the same seeded source and samples its
  slice (rank r the r-th of K), so groups never straddle ranks; token draws are keyed by the row's
  place among every rank's rows (``types.Draws``), so K ranks sample what one process samples.
- :meth:`DataParallel.gather_step` hands every rank the whole step's rollout: advantages, the loss's
  counts, the prompt source, callbacks and the logged batch metrics see the whole step, as on one
  process. The samplers' batch metrics are counts: concatenating the ranks' batches adds them up.
- Loss metrics and the loss's counts are summed over ranks (each loss is divided by the whole step's
  counts), gradients too, so every rank takes the same optimizer step; step times are the slowest
  rank's. Rank 0 alone logs, evaluates and writes; after the callbacks every rank takes rank 0's
  metrics and temperature, and stops or saves when any rank's callbacks asked.
- :class:`FullyShardedDataParallel` (``MemoryPlan(sharding="fsdp")``) also shards the decoder with
  FSDP2, gathers the whole model to sample, evaluate and save, runs every row on every rank (each
  pass is a collective), and writes the optimizer state as one shard per rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from grpo_engine import checkpoint
from grpo_engine.callbacks import TrainerControl
from grpo_engine.memory.apply import trainable_parameters
from grpo_engine.memory.plan import MemoryPlan
from grpo_engine.types import RewardOutput, Rollout, StepRollout
from grpo_engine.world import World, is_sharded

__all__ = ["DataParallel", "FullyShardedDataParallel", "parallelism", "World", "fully_shard_model",
           "full_weights", "is_sharded", "full_value"]


class DataParallel:
    """Every rank holds the whole model and trains its share of the step's rows (one process: all).

    Args:
        world: this process's place in the launch (``World()`` for one process).

    Example:
        >>> DataParallel(World()).rows_to_run(torch.tensor([2, 5]), 8).tolist()
        [2, 5]
    """

    share_prompt = True  # the log-prob passes may run each distinct prompt once

    def __init__(self, world: World) -> None:
        self.world = world

    def prepare(self, model: nn.Module) -> None:
        """Applies the strategy to the model, before its optimizer is built: rank 0's weights on every
        rank."""
        self.world.broadcast_parameters(trainable_parameters(model))

    def whole_weights(self, needed: bool = True) -> contextlib.AbstractContextManager:
        """The block runs with the whole model on this rank (always so here)."""
        return contextlib.nullcontext()

    def rows_to_run(self, counted: Tensor, num_rows: int) -> Tensor:
        """The rows this rank runs forward and backward: the ``counted`` ones (those that can change the
        gradient)."""
        return counted

    # -- the step's data ---------------------------------------------------------------------------

    def gather_step(self, local: Rollout) -> StepRollout:
        """The step's rollout on every rank: this rank's and every rank's in rank order."""
        parts = self.world.gather_objects(local.to_cpu()) if self.world.size > 1 else [local]
        whole = Rollout.concat(parts) if len(parts) > 1 else local
        if whole.uncertainty is not None and local.uncertainty is not None:  # back where the estimator put it
            whole = Rollout(whole.batch, whole.rewards, whole.uncertainty.to(local.uncertainty.device))
        return StepRollout(local, whole, tuple(p.batch.num_prompts for p in parts), self.world.rank)

    def gather_rewards(self, step: StepRollout, local: RewardOutput) -> StepRollout:
        """``step`` with this rank's rewards replaced by ``local`` and the whole step's gathered anew."""
        parts = self.world.gather_objects(local.to_cpu()) if self.world.size > 1 else [local]
        return step.with_rewards(local, RewardOutput.concat(parts) if len(parts) > 1 else local)

    def summed_metrics(self, sums: dict[str, Any]) -> dict[str, float]:
        """Every rank's sums of loss metrics added up, under the union of the ranks' keys (a rank that
        trained no row adds 0)."""
        keys = tuple(dict.fromkeys(key for keys in self.world.gather_objects(tuple(sums)) for key in keys))
        return dict(zip(keys, self.world.sum([float(sums.get(key, 0.0)) for key in keys])))

    def agree(self, metrics: dict[str, float], control: TrainerControl, temperature: float
              ) -> tuple[dict[str, float], float]:
        """After the callbacks: rank 0's metrics and temperature on every rank; ``control`` stops or
        saves when any rank's callbacks asked."""
        asks = self.world.gather_objects((control.should_stop, control.should_save))
        control.should_stop, control.should_save = (any(ask[i] for ask in asks) for i in range(2))
        return self.world.broadcast((metrics, temperature))

    # -- gradients and checkpoints ------------------------------------------------------------------

    def reduce_gradients(self, params: Iterable[nn.Parameter]) -> None:
        """Sums the gradients over the ranks."""
        self.world.sum_gradients(params)

    def save(self, path: Path, model: nn.Module, tokenizer: Any, optimizer: torch.optim.Optimizer,
             state: dict[str, Any], text_files: dict[str, str]) -> Path:
        """Writes a checkpoint (weights, tokenizer, ``text_files``, ``state`` with the optimizer's)
        from rank 0, durably; every rank returns once it is complete."""
        return self._write(path, model, tokenizer, text_files, {**state, "optimizer": optimizer.state_dict(),
                                                                "optimizer_format": "state_dict"})

    def load_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                       folder: Path) -> None:
        """Restores the optimizer from a checkpoint of either kind (whole, or one shard per rank)."""
        if state["optimizer_format"] == "dcp":
            checkpoint.load_sharded_optimizer(model, optimizer, folder / checkpoint.OPTIMIZER_DIR)
        else:
            optimizer.load_state_dict(state["optimizer"])

    def _write(self, path: Path, model: nn.Module, tokenizer: Any, text_files: dict[str, str],
               state: dict[str, Any], weights: dict[str, Tensor] | None = None,
               tmp: Path | None = None) -> Path:
        if self.world.is_main:
            checkpoint.save_pretrained_atomic(model, tokenizer, path, text_files,
                                              {checkpoint.STATE_FILE: state}, state_dict=weights, tmp=tmp)
        self.world.barrier()  # no rank moves on before the checkpoint is complete
        return Path(path)


class FullyShardedDataParallel(DataParallel):
    """Data parallel with the decoder sharded over the ranks by FSDP2 (``MemoryPlan(sharding="fsdp")``).

    Each decoder layer and the decoder (embeddings, final norm) hold 1/K of their weights, gradients
    and AdamW states per rank; the lm_head stays whole. Sampling, evaluation and saving gather the
    whole model; every rank runs every row (each pass is a collective) and no pass shares prompts.
    """

    share_prompt = False

    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.units: list[nn.Module] = []  # FSDP2's sharded modules, once prepared

    @staticmethod
    def check(memory: MemoryPlan, *, full_reference: bool, filters_groups: bool) -> None:
        """Raises ValueError for a setup FSDP2 cannot take here, naming it and the fix."""
        problems = []
        if filters_groups:
            problems.append("a sampler that drops groups (DynamicSampling: ranks would train unequal rows, "
                            "and every FSDP2 pass is a collective)")
        if memory.quantization is not None:
            problems.append("a 4-bit base (quantization='nf4')")
        if memory.optimizer != "adamw":
            problems.append(f"optimizer={memory.optimizer!r} (bitsandbytes states are not sharded)")
        if full_reference:
            problems.append("a frozen reference copy (a KL term under full fine-tuning)")
        if problems:
            raise ValueError(f"sharding='fsdp' does not take {' nor '.join(problems)}; use sharding='none', "
                             "or LoRA with optimizer='adamw' and no quantization")

    def prepare(self, model: nn.Module) -> None:
        super().prepare(model)
        self.units = fully_shard_model(model)

    def whole_weights(self, needed: bool = True) -> contextlib.AbstractContextManager:
        return full_weights(self.units if needed else ())

    def rows_to_run(self, counted: Tensor, num_rows: int) -> Tensor:
        """Every row: each forward and backward is a collective, so every rank runs as many as the others
        (a row with advantage 0 adds nothing to the gradient)."""
        return torch.arange(num_rows)

    def save(self, path: Path, model: nn.Module, tokenizer: Any, optimizer: torch.optim.Optimizer,
             state: dict[str, Any], text_files: dict[str, str]) -> Path:
        """The whole weights gathered on rank 0; every rank writes its optimizer shard into the
        checkpoint's temporary folder, which rank 0 completes and puts in place."""
        weights = checkpoint.gather_weights(model)
        tmp = self.world.broadcast(checkpoint.staging_folder(path) if self.world.is_main else None)
        checkpoint.save_sharded_optimizer(model, optimizer, tmp / checkpoint.OPTIMIZER_DIR)
        return self._write(path, model, tokenizer, text_files, {**state, "optimizer": None,
                                                                "optimizer_format": "dcp"}, weights, tmp)

    def load_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                       folder: Path) -> None:
        if state["optimizer_format"] == "dcp":
            checkpoint.load_sharded_optimizer(model, optimizer, folder / checkpoint.OPTIMIZER_DIR)
        else:  # a whole optimizer state (one process, data parallel) cut into this rank's shards
            checkpoint.load_whole_optimizer_sharded(model, optimizer, state["optimizer"])


def parallelism(memory: MemoryPlan, world: World, *, full_reference: bool, filters_groups: bool
                ) -> DataParallel:
    """The strategy of this launch: FSDP2 when the plan asks for it and there are several ranks (after
    :meth:`FullyShardedDataParallel.check`), else data parallel (one process included)."""
    if memory.sharding == "fsdp" and world.size > 1:
        FullyShardedDataParallel.check(memory, full_reference=full_reference, filters_groups=filters_groups)
        return FullyShardedDataParallel(world)
    return DataParallel(world)


# -- FSDP2 ----------------------------------------------------------------------------------------------


def fully_shard_model(model: nn.Module) -> list[nn.Module]:
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
                           f"(torch.distributed.fsdp), which torch {torch.__version__} lacks; install a "
                           "newer torch, or use sharding='none' (data parallel)")

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
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
def full_weights(units: Sequence[nn.Module]) -> Iterator[None]:
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


def full_value(value: Any) -> Any:
    """The whole value of a DTensor (a collective: call it on every rank), else the value itself."""
    return value.full_tensor() if is_sharded(value) else value
