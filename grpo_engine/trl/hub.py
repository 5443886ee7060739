"""``push_to_hub`` for TRL's entry: the hub layout is written to ``output_dir`` first (the policy, the adapter
under LoRA, and the tokenizer, by ``save_pretrained``, and a short model card), then the folder is uploaded
with ``huggingface_hub.upload_folder``, without the ``checkpoint-N`` and ``final`` folders, as TRL's Trainer
does. A push that fails (offline, no token, no rights) raises :class:`HubPushError` with the reason; the
saved folder stays as it is, and the error says how to push it later.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["HubPushError", "push_folder", "model_card"]

IGNORED = ["checkpoint-*", "final", "final/*", ".*", "*.tmp*"]


class HubPushError(RuntimeError):
    """The upload failed; ``folder`` holds what was saved, untouched."""

    def __init__(self, message: str, folder: Path) -> None:
        super().__init__(message)
        self.folder = folder


def model_card(base_model: str, dataset_name: str | None = None) -> str:
    """A short README.md: the base model, the dataset, and how the model was trained."""
    data = f"\non the dataset `{dataset_name}`" if dataset_name else ""
    return (f"---\nbase_model: {base_model}\ntags: [grpo, grpo_engine]\n---\n\n# {base_model} trained with "
            f"GRPO\n\nFine-tuned from `{base_model}`{data} with GRPO by grpo_engine "
            "(`from grpo_engine.trl import GRPOTrainer`).\n")


def push_folder(folder: Path, *, repo_id: str, token: str | None, private: bool | None,
                revision: str | None, commit_message: str) -> Any:
    """Uploads ``folder`` (less the checkpoints) to the model repository ``repo_id``, created when missing;
    returns ``upload_folder``'s commit record.

    Raises:
        HubPushError: the push failed; its message names the reason and the folder kept.
    """
    import huggingface_hub

    try:
        huggingface_hub.create_repo(repo_id, token=token, private=private, exist_ok=True)
        return huggingface_hub.upload_folder(repo_id=repo_id, folder_path=str(folder), token=token,
                                             revision=revision, commit_message=commit_message,
                                             ignore_patterns=IGNORED)
    except Exception as error:  # offline, no token, no rights: said, and the saved folder kept
        raise HubPushError(f"pushing {folder} to the hub repository {repo_id!r} failed: "
                           f"{type(error).__name__}: {error}. Nothing saved is lost: {folder} holds the "
                           "model; push it once online with huggingface_hub.upload_folder("
                           f"repo_id={repo_id!r}, folder_path={str(folder)!r})", folder) from error
