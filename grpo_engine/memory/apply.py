"""Applies a MemoryPlan to a transformers causal LM: dtype, 4-bit base, LoRA, checkpointing, optimizer.

Dropout of the base model is switched off: the log-probs of a completion must not depend on a dropout
draw, otherwise the importance ratio of an on-policy update would not be exactly 1. LoRA's own
``dropout`` is the user's choice (0 by default, which keeps it exact).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from grpo_engine._quiet import quiet_peft

if TYPE_CHECKING:  # applying a plan reads its fields; it never builds one
    from grpo_engine.memory.plan import MemoryPlan

__all__ = [
    "prepare_model", "build_optimizer", "ReferencePolicy", "trainable_parameters", "quantize_4bit_",
    "is_quantized_4bit", "is_peft", "activation_offload", "bnb_4bit_config", "autocast",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def prepare_model(model: nn.Module, plan: MemoryPlan) -> nn.Module:
    """Returns the policy to train: cast, dropout off, LoRA wrapped, checkpointing on.

    Args:
        model: a transformers ``PreTrainedModel`` for causal LM.
        plan: the memory plan.

    Returns:
        The model to train (a ``peft.PeftModel`` under LoRA). A ``PeftModel`` passed in (with
        ``plan.lora=None``) is trained as it is: its adapters, the base frozen.
    """
    dtype = _DTYPES[plan.dtype]
    if is_peft(model) and plan.lora is not None:
        raise ValueError("the model is already a PeftModel (it has LoRA adapters) and the MemoryPlan "
                         "adds another: pass MemoryPlan(lora=None) to train its adapters as they are, "
                         "or pass the base model")
    if is_quantized_4bit(model):
        if plan.quantization is None:
            raise ValueError("the model is loaded in 4 bits but the MemoryPlan has quantization=None; "
                             "use MemoryPlan(quantization='nf4', lora=LoRA(...)), "
                             "or load it without quantization")
        for param in model.parameters():  # 4-bit weights stay packed; embeddings and norms take the dtype
            if param.is_floating_point():
                param.data = param.data.to(dtype)
    else:
        model = model.to(dtype)
        if plan.quantization is not None:
            quantize_4bit_(model, compute_dtype=dtype)
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
        with quiet_peft():
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


def is_peft(model: nn.Module) -> bool:
    """Whether ``model`` is a peft ``PeftModel`` (it carries adapters)."""
    return any(cls.__name__ == "PeftModel" and cls.__module__.startswith("peft")
               for cls in type(model).__mro__)


def autocast(plan: MemoryPlan, device: torch.device) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to the plan's ``compute_dtype`` under mixed precision, else a no-op context.

    Example:
        >>> from grpo_engine.memory.plan import MemoryPlan
        >>> with autocast(MemoryPlan(compute_dtype="bfloat16"), torch.device("cpu")):
        ...     torch.ones(2, 2) @ torch.ones(2, 2)
        tensor([[2., 2.],
                [2., 2.]], dtype=torch.bfloat16)
    """
    if not plan.mixed_precision:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_DTYPES[plan.compute_dtype])


def bnb_4bit_config(plan: MemoryPlan):
    """The transformers ``BitsAndBytesConfig`` of the plan's 4-bit base (NF4, double quantisation)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=plan.quantization, bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=_DTYPES[plan.dtype],
    )


def is_quantized_4bit(model: nn.Module) -> bool:
    """Whether any weight of ``model`` is a bitsandbytes 4-bit parameter."""
    return any(type(p).__name__ == "Params4bit" for p in model.parameters())


def quantize_4bit_(model: nn.Module, *, compute_dtype: torch.dtype, quant_type: str = "nf4") -> nn.Module:
    """Replaces every ``nn.Linear`` but the output head with a bitsandbytes 4-bit layer, in place.

    The same layers transformers quantises when loading with ``load_in_4bit`` (the lm_head and the
    embeddings stay in ``compute_dtype``), with double quantisation of the block scales. The full-
    precision weights exist until each layer is replaced; to never hold them, load with
    ``grpo_engine.load_model(path, plan=plan)`` instead.
    """
    import bitsandbytes as bnb

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and module is not head]
    for name, linear in targets:
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                  compute_dtype=compute_dtype, compress_statistics=True,
                                  quant_type=quant_type)
        device = linear.weight.device
        layer.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, compress_statistics=True,
                                         quant_type=quant_type)
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.data, requires_grad=False)
        setattr(parent, name.rpartition(".")[2], layer.to(device))  # .to() quantises the weight
    model.is_loaded_in_4bit = True  # what transformers sets; peft then wraps the layers with its 4-bit LoRA
    return model


def activation_offload(plan: MemoryPlan) -> contextlib.AbstractContextManager:
    """The context a training forward + backward runs in: saved activations go to CPU memory when
    ``plan.offload_activations`` (pinned when CUDA is available, so the copies are asynchronous)."""
    if not plan.offload_activations:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())


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
    """AdamW (torch), or bitsandbytes 8-bit / paged AdamW, over the trainable parameters."""
    params = trainable_parameters(model)
    if not params:
        raise ValueError("the model has no trainable parameters; check MemoryPlan.lora.target_modules "
                         "or that the base model is not frozen")
    if plan.optimizer == "adamw":
        shards = sum(hasattr(p, "full_tensor") for p in params)  # FSDP2's DTensors
        # the fused kernel: on a GPU one launch per step, not several per tensor; on the CPU (whole tensors)
        # no temporaries the size of a parameter (the for-loop step makes two for its largest)
        fused = all(p.is_floating_point() and (p.is_cuda or (p.device.type == "cpu" and not shards))
                    for p in params)
        mixed = 0 < shards < len(params)  # with whole tensors (a replicated lm_head): one tensor at a time
        return torch.optim.AdamW(params, lr=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay,
                                 fused=(fused and not mixed) or None, foreach=False if mixed else None)
    try:
        import bitsandbytes as bnb
    except ImportError as exc:  # pragma: no cover - bitsandbytes is a core dependency
        raise ImportError(f"MemoryPlan(optimizer={plan.optimizer!r}) needs bitsandbytes: "
                          "pip install bitsandbytes") from exc
    cls = {"adamw8bit": bnb.optim.AdamW8bit, "paged_adamw": bnb.optim.PagedAdamW,
           "paged_adamw8bit": bnb.optim.PagedAdamW8bit}[plan.optimizer]
    return cls(params, lr=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay)


class ReferencePolicy:
    """The frozen policy of the KL term, without a second copy when it can be avoided.

    Under LoRA (or for a PeftModel) the reference is the policy with its adapters disabled; under full
    fine-tuning it is a frozen deep copy made at construction (only build one when the KL coefficient
    is non-zero).

    Example:
        >>> # with ReferencePolicy(policy, plan).active() as ref_model: logprobs(ref_model, ...)
    """

    def __init__(self, policy: nn.Module, plan: MemoryPlan) -> None:
        self._policy = policy
        self._copy: nn.Module | None = None
        if plan.lora is None and not is_peft(policy):
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

    def _frozen_copy(self, what: str) -> nn.Module:
        if self._copy is None:
            raise ValueError(f"{what} needs a reference copy, but under LoRA the reference is the policy "
                             "with its adapters off (nothing to move); train without LoRA, or drop the "
                             "reference sync")
        return self._copy

    def mix(self, alpha: float) -> None:
        """θ_ref ← α·θ + (1 - α)·θ_ref, parameter by parameter, in place (TR-DPO's soft update; α = 1 copies
        the policy). Full fine-tuning only."""
        with torch.no_grad():
            pairs = zip(self._frozen_copy("mix").parameters(), self._policy.parameters(), strict=True)
            for ref, live in pairs:
                ref.mul_(1.0 - alpha).add_(live.detach().to(ref.dtype), alpha=alpha)

    def state_dict(self) -> dict[str, Tensor]:
        """The reference copy's weights (for a checkpoint once :meth:`mix` has moved them)."""
        return {k: v.detach().clone() for k, v in self._frozen_copy("state_dict").state_dict().items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self._frozen_copy("load_state_dict").load_state_dict(state)
