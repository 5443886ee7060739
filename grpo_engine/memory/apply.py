"""Applies a MemoryPlan to a transformers causal LM: dtype, LoRA, checkpointing, optimizer.

Dropout of the base model is switched off (as TRL does for GRPO): the log-probs of a completion
must not depend on a dropout draw, otherwise the importance ratio of an on-policy update would not
be exactly 1. LoRA's own ``dropout`` is the user's choice (0 by default, which keeps it exact).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

from grpo_engine.memory.plan import MemoryPlan

__all__ = ["prepare_model", "build_optimizer", "ReferencePolicy", "trainable_parameters"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def prepare_model(model: nn.Module, plan: MemoryPlan) -> nn.Module:
    """Returns the policy to train: cast, dropout off, LoRA wrapped, checkpointing on.

    Args:
        model: a transformers ``PreTrainedModel`` for causal LM.
        plan: the memory plan.

    Returns:
        The model to train (a ``peft.PeftModel`` under LoRA).
    """
    model = model.to(_DTYPES[plan.dtype])
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0  # attention modules that call the dropout function themselves
    if plan.lora is not None:
        from peft import LoraConfig, get_peft_model

        if plan.gradient_checkpointing:
            model.enable_input_require_grads()
        config = LoraConfig(
            r=plan.lora.r,
            lora_alpha=plan.lora.alpha,
            lora_dropout=plan.lora.dropout,
            target_modules=plan.lora.target_modules,
            task_type="CAUSAL_LM",
            bias="none",
        )
        model = get_peft_model(model, config)
        for name, param in model.named_parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.float()  # fp32 master weights for the adapters
                assert "lora_" in name, name
    if plan.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that receive gradients."""
    return [p for p in model.parameters() if p.requires_grad]


def build_optimizer(
    model: nn.Module,
    plan: MemoryPlan,
    *,
    learning_rate: float,
    betas: tuple[float, float] = (0.9, 0.99),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> torch.optim.Optimizer:
    """AdamW (torch) or 8-bit AdamW (bitsandbytes) over the trainable parameters."""
    params = trainable_parameters(model)
    if not params:
        raise ValueError("the model has no trainable parameters; check MemoryPlan.lora.target_modules "
                         "or that the base model is not frozen")
    if plan.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay)
    try:
        import bitsandbytes as bnb
    except ImportError as exc:  # pragma: no cover - bitsandbytes is a core dependency
        raise ImportError("MemoryPlan(optimizer='adamw8bit') needs bitsandbytes: pip install bitsandbytes") from exc
    return bnb.optim.AdamW8bit(params, lr=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay)


class ReferencePolicy:
    """The frozen policy of the KL term, without a second copy when it can be avoided.

    Under LoRA the reference is the policy with its adapters disabled; under full fine-tuning it is
    a frozen deep copy made at construction (only build one when the KL coefficient is non-zero).

    Example:
        >>> # with ReferencePolicy(policy, plan).active() as ref_model: logprobs(ref_model, ...)
    """

    def __init__(self, policy: nn.Module, plan: MemoryPlan) -> None:
        self._policy = policy
        self._copy: nn.Module | None = None
        if plan.lora is None:
            self._copy = copy.deepcopy(policy).eval()
            for p in self._copy.parameters():
                p.requires_grad_(False)

    @contextlib.contextmanager
    def active(self) -> Iterator[nn.Module]:
        """Yields a module whose forward is the reference policy."""
        if self._copy is not None:
            yield self._copy
        else:
            with self._policy.disable_adapter():
                yield self._policy
