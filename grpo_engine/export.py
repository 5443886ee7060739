"""Export a trained policy as a plain transformers folder, with its LoRA adapter merged into the weights:
loadable by ``AutoModelForCausalLM.from_pretrained`` and by serving engines that do not read adapters.

- :func:`merged_copy`: a merged copy of a ``PeftModel`` (the model being trained is left as it is).
- :func:`save_merged`: writes a merged copy and the tokenizer, durably (``trainer.save_merged`` calls it).
- :func:`export_run`: merges a saved run's adapter (``final/``, a ``checkpoint-N/`` or the run folder,
  whose newest checkpoint is taken) into its base model (``grpo-engine export RUN --merge OUT``).

A 4-bit (QLoRA) base is refused: merging into 4-bit weights would lose the update; export from a run
folder loads the base in float instead.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from torch import nn

from grpo_engine import checkpoint
from grpo_engine._quiet import quiet_peft
from grpo_engine.memory.apply import is_peft, is_quantized_4bit

__all__ = ["merged_copy", "save_merged", "export_run"]


def merged_copy(model: nn.Module) -> nn.Module:
    """A plain transformers model with the adapters of ``model`` (a ``PeftModel``) merged into a copy of
    its weights; a model without adapters is returned as a copy.

    Raises:
        ValueError: the base is quantized to 4 bits.
    """
    if is_quantized_4bit(model):
        raise ValueError("the base model is quantized to 4 bits (QLoRA): merging into it would lose the LoRA "
                         "update; export the saved run instead (grpo-engine export RUN --merge OUT), "
                         "which loads the base in float")
    twin = copy.deepcopy(model)
    return twin.merge_and_unload() if is_peft(twin) else twin


def save_merged(model: nn.Module, tokenizer: Any, path: str | Path) -> Path:
    """Writes the merged model (:func:`merged_copy`) and ``tokenizer`` to ``path``, durably."""
    merged = merged_copy(model)
    merged.train(False)
    return checkpoint.save_pretrained_atomic(merged, tokenizer, path, {}, {})


def export_run(run: str | Path, out: str | Path, *, base: str | Path | None = None,
               dtype: str = "float32") -> Path:
    """Merges a saved run's adapter into its base model and writes a plain transformers folder.

    Args:
        run: a run folder (its newest checkpoint is taken), or a ``final/`` / ``checkpoint-N/`` folder.
        out: the folder to write.
        base: the base model; default: the run's ``run.yaml`` ``model``, else the adapter's
            ``base_model_name_or_path``.
        dtype: the dtype to load the base in, and to save.

    Raises:
        FileNotFoundError: no adapter there, or no base model named anywhere.
    """
    from peft import PeftModel

    from grpo_engine.models import load_model

    run = Path(run)
    folder = run if (run / "adapter_config.json").is_file() else checkpoint.latest_checkpoint(run)
    if folder is None or not (folder / "adapter_config.json").is_file():
        full = folder is not None and any(folder.glob("model*.safetensors"))
        raise FileNotFoundError(f"no LoRA adapter in {run} (no adapter_config.json)"
                                + ("; it holds full weights: load it with AutoModelForCausalLM as it is"
                                   if full else "; point at a run folder, final/ or a checkpoint-N/ folder"))
    base = base or _base_of(folder)
    model, tokenizer = load_model(base, dtype=dtype)
    with quiet_peft():
        merged = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    merged.train(False)
    return checkpoint.save_pretrained_atomic(merged, tokenizer, out, {}, {})


def _base_of(folder: Path) -> str:
    for run_file in (folder / "run.yaml", folder.parent / "run.yaml"):
        if run_file.is_file():
            from grpo_engine.config import load_yaml

            return str(load_yaml(run_file)["model"])
    named = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if named:
        return str(named)
    raise FileNotFoundError(f"{folder} does not name its base model (no run.yaml, and the adapter's "
                            "base_model_name_or_path is empty); pass it: --base PATH")
