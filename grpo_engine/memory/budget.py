"""Picks the cheapest ``MemoryPlan`` whose predicted peak fits a memory budget (``grpo-engine plan``).

Candidates start from a base plan (default: LoRA r=16 in bfloat16) and add, in every combination, a
smaller micro-batch, 8-bit optimizer states, gradient checkpointing, a 4-bit NF4 base and activation
offload; each choice's slowdown is the product of its parts' estimated costs (docs/memory.md), and
the cheapest whose peak (``memory/estimate.py``) plus a margin fits wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from grpo_engine.memory.estimate import GIB, MemoryEstimate, Workload, estimate_memory
from grpo_engine.memory.plan import LoRA, MemoryPlan

__all__ = ["PlanChoice", "plan_for_budget", "auto_plan"]


@dataclass(frozen=True)
class PlanChoice:
    """What ``plan_for_budget`` chose, its estimate, and why."""

    plan: MemoryPlan
    estimate: MemoryEstimate
    slowdown: float
    reason: str
    # (plan summary, peak GiB) that did not fit
    rejected: list[tuple[str, float]] = field(default_factory=list)


# Relative step time of each memory saving (documented estimates, not measurements; docs/memory.md):
_SLOWDOWN = {"gradient_checkpointing": 1.25, "adamw8bit": 1.01, "quantization": 1.2,
             "offload_activations": 1.1}


def _summary(plan: MemoryPlan) -> str:
    bits = [f"LoRA r={plan.lora.r}" if plan.lora else "full fine-tuning", plan.dtype]
    bits += ["NF4 base"] if plan.quantization else []
    bits += ["gradient checkpointing"] if plan.gradient_checkpointing else []
    bits += [plan.optimizer, f"micro-batch {plan.micro_batch_size}"]
    tile = plan.logprob_vocab_tile
    bits += [f"log-prob chunks of {plan.logprob_chunk_size} tokens x "
             + (f"{tile}-entry vocabulary tiles" if tile else "the whole vocabulary")]
    bits += ["activations offloaded"] if plan.offload_activations else []
    return ", ".join(bits)


def plan_for_budget(model: Any, workload: Workload, budget_gib: float, *, base: MemoryPlan | None = None,
                    margin: float = 0.15, ranks: int = 1, sampler: str = "ours") -> PlanChoice:
    """The plan with the least slowdown whose predicted peak, plus ``margin``, fits ``budget_gib``.

    Candidates start from ``base`` (default: LoRA r=16 in bfloat16, prompt sharing on) and add, in
    every combination, a smaller micro-batch (halving; ~2% slower each), 8-bit optimizer states,
    gradient checkpointing, a 4-bit NF4 base (under LoRA) and, with checkpointing, activation
    offload (then only the layer inputs travel to CPU memory). Each choice's slowdown is the product
    of its parts' estimated costs; the cheapest that fits wins. Its "auto" log-prob chunks and tiles are
    resolved for the budget (the fewest passes whose logits fit what the rest leaves,
    ``estimate.logprob_granularity``) and written into the plan returned.

    ``ranks``: torchrun processes, for a ``base`` with ``sharding="fsdp"`` (which takes no 4-bit base nor
    8-bit states); ``workload`` is then one rank's. ``sampler="vllm"``: sampling runs in a colocated vLLM
    engine, whose share is not in ``budget_gib`` (``estimate_memory``'s ``sampler``).

    Raises:
        ValueError: when no candidate fits, naming the smallest peak found.
    """
    base = base if base is not None else MemoryPlan(lora=LoRA(r=16, alpha=32), dtype="bfloat16")
    if budget_gib <= 0:
        raise ValueError(f"budget_gib={budget_gib} must be > 0; pass the accelerator's memory in GiB, e.g. 8")
    micro = [m for m in (workload.rows, 16, 8, 4, 2, 1) if m <= min(workload.rows, base.micro_batch_size)]
    micro = sorted(set(micro) | {min(workload.rows, base.micro_batch_size)}, reverse=True)
    candidates: list[tuple[float, MemoryPlan]] = []
    for m in micro:
        sharded = base.sharding == "fsdp"
        for eight_bit in ((False,) if sharded else (False, True)):
            for ckpt in (False, True):
                for quant in ((False, True) if base.lora is not None and not sharded else (False,)):
                    for offload in ((False, True) if ckpt or base.gradient_checkpointing else (False,)):
                        plan = base.model_copy(update={
                            "micro_batch_size": m,
                            "optimizer": "adamw8bit" if eight_bit else base.optimizer,
                            "gradient_checkpointing": ckpt or base.gradient_checkpointing,
                            "quantization": "nf4" if quant else base.quantization,
                            "offload_activations": offload or base.offload_activations,
                        })
                        slow = 1.02 ** math.log2(micro[0] / m)
                        slow *= _SLOWDOWN["adamw8bit"] if eight_bit else 1.0
                        slow *= _SLOWDOWN["gradient_checkpointing"] if ckpt else 1.0
                        slow *= _SLOWDOWN["quantization"] if quant else 1.0
                        slow *= _SLOWDOWN["offload_activations"] if offload else 1.0
                        candidates.append((slow, plan))
    candidates.sort(key=lambda c: c[0])
    rejected: list[tuple[str, float]] = []
    limit = budget_gib / (1 + margin)
    for slow, plan in candidates:
        est = estimate_memory(model, plan, workload, ranks=ranks, sampler=sampler, budget_bytes=limit * GIB)
        # "auto" log-prob chunks and tiles: the ones the estimate fitted, written into the plan the run takes
        chunk, tile = est.logprob_granularity
        plan = plan.model_copy(update={"logprob_chunk_size": chunk, "logprob_vocab_tile": tile})
        if est.peak_gib <= limit:
            reason = (f"{_summary(plan)}: predicted peak {est.peak_gib:.2f} GiB ({est.peak_phase}) "
                      f"fits {budget_gib:g} GiB with a {margin:.0%} margin; estimated step time x{slow:.2f} "
                      f"of the fastest candidate; {len(rejected)} faster candidates did not fit")
            return PlanChoice(plan=plan, estimate=est, slowdown=slow, reason=reason, rejected=rejected)
        rejected.append((_summary(plan), est.peak_gib))
    smallest = min(rejected, key=lambda r: r[1])
    raise ValueError(f"no plan fits {budget_gib:g} GiB (with a {margin:.0%} margin): the smallest "
                     f"predicted peak is {smallest[1]:.2f} GiB ({smallest[0]}); shorten completion_tokens, "
                     "lower group_size or prompts_per_step, or use a smaller model")


def auto_plan(model: Any, workload: Any, budget_gib: float, *, base: MemoryPlan | None = None,
              margin: float = 0.15, verbose: bool = True) -> MemoryPlan:
    """The plan with the least estimated slowdown whose predicted peak fits ``budget_gib``.

    Args:
        model: a transformers config, a folder with ``config.json``, a loaded model (its ``config``
            is used) or a name in ``grpo_engine.memory.estimate.KNOWN_SHAPES``.
        workload: a ``Workload`` or a ``GRPOConfig`` (its B, G and maximum lengths).
        budget_gib: the accelerator memory to fit in, GiB.
        base: the plan to start from (default LoRA r=16 in bfloat16).
        margin: safety margin on the predicted peak (0.15: the estimator's accuracy goal).
        verbose: print what was chosen and why.

    Example:
        >>> auto_plan("qwen2.5-7b", Workload(completion_tokens=1024), 12, verbose=False).quantization
        'nf4'
    """
    if not isinstance(workload, Workload):
        workload = Workload.from_config(workload)
    choice = plan_for_budget(getattr(model, "config", model), workload, budget_gib, base=base, margin=margin)
    if verbose:
        print(f"[auto_plan] {choice.reason}")
    return choice.plan
