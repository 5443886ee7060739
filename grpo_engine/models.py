"""Loading a policy and its tokenizer from a local folder or a hub id, and preparing it to train: on this
rank's device, under its ``MemoryPlan``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from grpo_engine.world import World

__all__ = ["load_model", "load_policy"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(name_or_path: str | Path, *, dtype: str = "float32", plan=None):
    """Loads a causal LM and its tokenizer; the tokenizer gets a pad token if it has none.

    Args:
        name_or_path: a local folder in transformers layout, or a hub id (needs the network once).
        dtype: "float32", "bfloat16" or "float16".
        plan: a ``MemoryPlan``; its ``dtype`` replaces ``dtype``, and with ``quantization="nf4"`` the
            linear layers are quantised to 4 bits while loading, so the full-precision weights are
            never all in memory at once.

    Returns:
        ``(model, tokenizer)``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(name_or_path))
        kwargs = {}
        if plan is not None:
            dtype = plan.dtype
            if plan.quantization is not None:
                from grpo_engine.memory.apply import bnb_4bit_config

                device = "cuda" if torch.cuda.is_available() else "cpu"
                kwargs = {"quantization_config": bnb_4bit_config(plan), "device_map": device}
        model = AutoModelForCausalLM.from_pretrained(str(name_or_path), dtype=_DTYPES[dtype], **kwargs)
    except OSError as exc:
        raise OSError(f"could not load model {str(name_or_path)!r}: {exc}. "
                      "Pass a local folder in transformers layout (config.json + weights + tokenizer), "
                      "or a hub id while online") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load_policy(model: str | Path | nn.Module, tokenizer: Any, plan: Any,
                world: Any) -> tuple[nn.Module, Any]:
    """The policy to train and its tokenizer: ``model`` loaded when it is a folder or hub id, put on this
    rank's device (:func:`place_model`), and prepared by the ``MemoryPlan`` ``plan`` (dtype, 4-bit base,
    LoRA, checkpointing).

    Raises:
        ValueError: a model object without its tokenizer.
    """
    from grpo_engine.memory.apply import prepare_model

    loaded_here = isinstance(model, (str, Path))
    if loaded_here:
        model, loaded_tokenizer = load_model(model, plan=plan)
        tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
    if tokenizer is None:
        raise ValueError("a model object needs its tokenizer: pass GRPOTrainer(model, ..., "
                         "tokenizer=tokenizer)")
    model = place_model(model, world, loaded_here=loaded_here, quantized=plan.quantization is not None)
    return prepare_model(model, plan), tokenizer


def place_model(model: nn.Module, world: World, *, loaded_here: bool, quantized: bool) -> nn.Module:
    """The model on this rank's device: a model the trainer loaded goes to the GPU when there is one
    (a 4-bit one was loaded onto it); one the caller placed on a GPU goes to this rank's GPU."""
    on_gpu = next(model.parameters()).device.type == "cuda"
    if (loaded_here and not quantized and world.device.type == "cuda") or (world.size > 1 and on_gpu):
        return model.to(world.device)
    return model
