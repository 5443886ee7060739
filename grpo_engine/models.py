"""Loading a policy and its tokenizer from a local folder or a hub id, and preparing it to train: on this
rank's device, under its ``MemoryPlan``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from grpo_engine.world import World

__all__ = ["load_model", "load_policy", "place_model"]

logger = logging.getLogger(__name__)

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


def load_policy(model: str | Path | nn.Module, tokenizer: Any, plan: Any, world: Any,
                placement: str = "auto") -> tuple[nn.Module, Any]:
    """The policy to train and its tokenizer: ``model`` loaded when it is a folder or hub id, put on this
    rank's device (:func:`place_model`, ``placement``: ``GRPOConfig.place_model``), and prepared by the
    ``MemoryPlan`` ``plan`` (dtype, 4-bit base, LoRA, checkpointing).

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
    model = place_model(model, world, loaded_here=loaded_here, quantized=plan.quantization is not None,
                        placement=placement)
    return prepare_model(model, plan), tokenizer


def place_model(model: nn.Module, world: World, *, loaded_here: bool, quantized: bool,
                placement: str = "auto") -> nn.Module:
    """The model on this rank's device (``world.device``), moved in place.

    A model the trainer loaded goes to the GPU when there is one (a 4-bit one was loaded onto it). A model
    object goes there too under ``placement="auto"``, as TRL does, with a log line (logger
    ``grpo_engine.models``, level INFO); ``"keep"`` leaves it where it is, except that under torchrun one
    on a GPU goes to this rank's GPU. A bitsandbytes-quantised model or one dispatched over several devices
    (``hf_device_map``) cannot be moved: it stays, and the log line says why. Nothing moves on a CPU
    machine.

    Example:
        >>> place_model(nn.Linear(2, 2), World(), loaded_here=False, quantized=False).weight.device.type
        'cpu'
    """
    device, where = world.device, next(model.parameters()).device
    wanted = not quantized if loaded_here else placement == "auto"
    moves = device.type == "cuda" and (wanted or world.size > 1 and where.type == "cuda")
    if not moves or where == device:
        return model
    stuck = None if loaded_here else unmovable(model)
    if stuck is not None:
        logger.info("the model stays on %s, not on this rank's %s: %s", where, device, stuck)
        return model
    if not loaded_here:
        why = ("GRPOConfig(place_model='keep') leaves it where it is" if placement == "auto" else
               "under torchrun each rank trains on its own GPU")
        logger.info("moving the model from %s to %s (%s)", where, device, why)
    return model.to(device)


def unmovable(model: nn.Module) -> str | None:
    """Why ``model`` is not moved to another device (None when it can be), as accelerate (TRL's placement)
    leaves it: bitsandbytes-quantised weights (placed and packed where they were loaded), or layers
    dispatched over several devices (``hf_device_map``, with accelerate's hooks)."""
    from grpo_engine.memory.apply import is_quantized_4bit

    flags = ("is_loaded_in_4bit", "is_loaded_in_8bit")  # what transformers (and quantize_4bit_) set
    if any(getattr(model, flag, False) for flag in flags) or is_quantized_4bit(model):
        return ("a bitsandbytes-quantised model trains where it was loaded; load it onto this GPU "
                "(from_pretrained(..., device_map=...)) or pass its folder to GRPOTrainer")
    devices = set((getattr(model, "hf_device_map", None) or {}).values())
    if len(devices) > 1:
        return (f"its hf_device_map spreads it over {sorted(map(str, devices))}; it trains as it was "
                "dispatched")
    return None
