"""Reference-policy sync: TR-DPO's soft update of the KL reference (Gorbatovski et al., "Learn Your
Reference Model for Real Good Alignment", arXiv 2404.09656, §3).

Every τ optimizer steps (after step k with k mod τ = 0):

    θ_ref ← α · θ + (1 - α) · θ_ref

α = 1 is the hard update (the reference becomes the policy); α < 1 a mix-up. The paper's values: α in
[0.5, 0.8] with τ = 32 to 512 (soft), or τ = 256 to 1024 (hard). TRL 1.16 does the same
(``sync_ref_model=True``, ``ref_model_mixup_alpha`` 0.6, ``ref_model_sync_steps`` 512; its
``SyncRefModelCallback``) and, as here, only for a full reference copy (not under LoRA / PEFT). The
callback touches nothing but ``trainer.reference`` (a :class:`~grpo_engine.memory.apply.ReferencePolicy`)
through its public ``mix``; the moved weights are part of its checkpoint state.
"""

from __future__ import annotations

from typing import Any

from grpo_engine.callbacks import Callback, TrainerControl, TrainerState

__all__ = ["ReferenceSync"]


class ReferenceSync(Callback):
    """Mixes the policy into the KL reference every ``every_steps`` steps (TR-DPO).

    Args:
        every_steps: τ >= 1 (TRL ``ref_model_sync_steps``, default 512).
        alpha: α in (0, 1] (TRL ``ref_model_mixup_alpha``, default 0.6).

    Example:
        >>> # GRPOTrainer(..., loss=ClippedSurrogate(kl_coef=0.04), callbacks=[ReferenceSync(512, 0.6)])
        >>> ReferenceSync(every_steps=64, alpha=1.0)
        ReferenceSync(every_steps=64, alpha=1.0)
    """

    def __init__(self, every_steps: int = 512, alpha: float = 0.6) -> None:
        problems = []
        if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1:
            problems.append(f"every_steps={every_steps!r} must be an int >= 1 (TR-DPO: 32 to 1024)")
        if not 0 < alpha <= 1:
            problems.append(f"alpha={alpha!r} must be in (0, 1] (1 copies the policy; TR-DPO: 0.5 to 0.8)")
        if problems:
            raise ValueError("invalid ReferenceSync: " + "; ".join(problems))
        self.every_steps, self.alpha = every_steps, alpha
        self.reference: Any = None  # the trainer's ReferencePolicy, from on_init
        self.moved = False  # whether a sync has moved it from the initial policy (then checkpoints keep it)
        self.saved: dict[str, Any] | None = None  # weights from a checkpoint, applied at train start

    def __repr__(self) -> str:
        return f"ReferenceSync(every_steps={self.every_steps}, alpha={self.alpha})"

    def on_init(self, trainer: Any, state: TrainerState, control: TrainerControl) -> None:
        if getattr(trainer, "reference", None) is None:
            raise ValueError("ReferenceSync: this run has no reference policy (nothing uses one); give the "
                             "loss a KL term (e.g. ClippedSurrogate(kl_coef=0.04)) or drop the callback")
        trainer.reference.state_dict()  # refuses a reference without its own weights (LoRA) now, not later
        self.reference = trainer.reference

    def on_train_start(self, trainer: Any, state: TrainerState, control: TrainerControl) -> None:
        if self.saved is not None:
            trainer.reference.load_state_dict(self.saved)
            self.saved, self.moved = None, True

    def on_step_end(self, trainer: Any, state: TrainerState, control: TrainerControl, *,
                    metrics: dict[str, Any]) -> None:
        if state.step % self.every_steps == 0:
            trainer.reference.mix(self.alpha)
            self.moved = True
            metrics["reference/synced"] = 1.0

    def state_dict(self) -> dict[str, Any]:
        """The reference weights once a sync has moved them (else None: a resumed run rebuilds it)."""
        return {"reference": self.reference.state_dict() if self.moved and self.reference else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved = state.get("reference")
