"""Saving a trained policy without ever leaving a half-written folder.

The model (a peft adapter under LoRA, the full model otherwise), its tokenizer and the run's
config files are written to a temporary sibling folder, which then replaces the target in one
rename. A crash mid-save leaves the previous save untouched.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from torch import nn

__all__ = ["save_pretrained_atomic"]


def save_pretrained_atomic(model: nn.Module, tokenizer, path: str | Path,
                           extra_files: dict[str, str] | None = None) -> Path:
    """Saves ``model`` and ``tokenizer`` in the usual transformers / peft layout at ``path``.

    Args:
        model: a transformers model or a peft model (then only the adapter is written).
        tokenizer: saved beside it, so the folder loads on its own.
        path: the target folder; an existing folder there is replaced only once the new one is complete.
        extra_files: file name -> text, written beside the weights (for example the run's YAML config).

    Returns:
        The target path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        if path.exists():
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path
