"""Skywork-OR1's adaptive entropy control (He et al., arXiv 2505.22312, §3.2): an entropy bonus whose
coefficient follows the policy's entropy toward a target.

At optimizer step k, with H_k the step's token-mean entropy and H_tgt the target:

    loss_k   = aggregate(ℓ) - α_k · aggregate(H)          α_k = c_k · 1[H_{k-1} <= H_tgt]
    c_{k+1}  = clamp(c_k + Δ, c_min, c_max)  if H_k <= H_tgt
               clamp(c_k - Δ, c_min, c_max)  otherwise

so the bonus acts only while the entropy is at or below the target, and grows the longer it stays there.
The paper gates and updates with H_k, the entropy of the batch being trained on; the loss of step k is
computed before H_k is known (it is the sum of its micro-batches), so here, as in TRL 1.16
(``use_adaptive_entropy``), the gate uses the previous step's entropy (no bonus before the first
measurement) and the update the step's own. The entropy is that of π_θ at the sampling temperature, with
gradient, aggregated like the loss (TRL: the token mean, which ``aggregation="token"`` gives exactly).

:class:`AdaptiveEntropyBonus` is both a ``LossTerm`` (pass it in ``ClippedSurrogate(terms=...)``) and a
``Callback`` (pass the same object in ``GRPOTrainer(callbacks=...)``: ``on_step_end`` reads the step's
``entropy`` metric and updates c); its state (c and the last entropy) is checkpointed.
"""

from __future__ import annotations

import math
from typing import Any

from grpo_engine.callbacks import Callback, TrainerControl, TrainerState
from grpo_engine.losses._common import masked
from grpo_engine.losses.aggregation import token_share
from grpo_engine.types import MicroBatch, Requirements, TokenLoss

__all__ = ["AdaptiveEntropyBonus"]


class AdaptiveEntropyBonus(Callback):
    """Entropy bonus -α_k · H with Skywork-OR1's adaptive coefficient (see the module docstring).

    Args:
        entropy_target: H_tgt, the token-mean entropy (nats) to hold (TRL's name); the paper uses 0.2 for
            its 7B and 32B runs.
        coef: c_0 >= 0, the starting coefficient (paper and TRL ``entropy_coef``: 0).
        delta: Δ > 0, the change per step (paper and TRL ``entropy_coef_delta``: 0.005).
        coef_min, coef_max: the bounds of c (TRL ``entropy_coef_min`` 0, ``entropy_coef_max`` 1).

    Example:
        >>> bonus = AdaptiveEntropyBonus(entropy_target=0.2)
        >>> bonus.update(0.1); bonus.coef, bonus.applied_coef   # low entropy: c rises, the bonus is on
        (0.005, 0.005)
        >>> bonus.update(0.5); bonus.coef, bonus.applied_coef   # high: c falls, the bonus is off
        (0.0, 0.0)
    """

    def __init__(self, entropy_target: float, coef: float = 0.0, delta: float = 0.005, coef_min: float = 0.0,
                 coef_max: float = 1.0) -> None:
        problems = [f"{name}={value!r} must be >= 0" for name, value in
                    (("entropy_target", entropy_target), ("coef_min", coef_min)) if not value >= 0]
        if not delta > 0:
            problems.append(f"delta={delta!r} must be > 0 (the paper uses 0.005)")
        if not coef_min <= coef <= coef_max:
            problems.append(f"coef={coef!r} must lie in [coef_min, coef_max] = [{coef_min}, {coef_max}]")
        if problems:
            raise ValueError("invalid AdaptiveEntropyBonus: " + "; ".join(problems))
        self.entropy_target, self.delta = entropy_target, delta
        self.coef_min, self.coef_max = coef_min, coef_max
        self.start_coef = float(coef)  # a setting: the repr (and a checkpoint's description) shows it
        self.coef, self.last_entropy = float(coef), math.inf  # the state, in state_dict()

    def __repr__(self) -> str:
        return (f"AdaptiveEntropyBonus(entropy_target={self.entropy_target}, coef={self.start_coef}, "
                f"delta={self.delta}, coef_min={self.coef_min}, coef_max={self.coef_max})")

    def __str__(self) -> str:  # how errors name it: the setting that made it
        return f"adaptive entropy_target={self.entropy_target}"

    @property
    def requires(self) -> Requirements:
        return Requirements(entropy=True, zero_advantage_rows=True)

    @property
    def applied_coef(self) -> float:
        """α of the next step: c while the last measured entropy is at or below the target, else 0."""
        return self.coef if self.last_entropy <= self.entropy_target else 0.0

    def __call__(self, tokens: TokenLoss, batch: MicroBatch) -> TokenLoss:
        entropy = masked(batch.entropy, tokens.mask, tokens.logprobs.dtype)
        share = token_share(entropy, tokens.mask, tokens.num_valid_tokens).detach()
        coef = self.applied_coef
        return tokens.replace(penalty=tokens.penalty - coef * entropy, metrics={"entropy": share})

    def update(self, entropy: float) -> None:
        """End of a step whose token-mean entropy was ``entropy``: moves c by Δ and remembers it."""
        step = self.delta if entropy <= self.entropy_target else -self.delta
        self.coef = min(max(self.coef + step, self.coef_min), self.coef_max)
        self.last_entropy = float(entropy)

    def on_step_end(self, trainer: Any, state: TrainerState, control: TrainerControl, *,
                    metrics: dict[str, Any]) -> None:
        if "entropy" in metrics:  # a step that trained nothing measured nothing
            self.update(float(metrics["entropy"]))
        metrics["entropy_coef"] = self.applied_coef

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef, self.last_entropy = float(state["coef"]), float(state["last_entropy"])
