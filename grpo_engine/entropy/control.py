"""An adaptive sampling temperature steered by the semantic entropy of each group's answers.

Per prompt group of a step it takes the normalised semantic entropy ``SE / log G`` in [0, 1] and the
accuracy (the fraction of the group judged correct). A group is **collapsed** (:func:`collapsed_groups`)
when ``SE_norm <= threshold`` and ``accuracy < 1``: the completions agree on an answer that is not
right for all, so the group has (almost) no reward variance. :class:`AdaptiveTemperature` (after
E3-RL4LLMs' dynamic temperature, arXiv 2505.18573) raises the temperature by ``step`` when more than
``collapse_fraction`` of the groups collapsed, else lowers it when the mean SE is at least
``scatter_entropy``, within ``[min_temperature, max_temperature]``. The online curriculum is
:class:`grpo_engine.data.InformativeCurriculum`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grpo_engine.callbacks import Callback, TrainerControl, TrainerState
from grpo_engine.types import RewardOutput, RolloutBatch

__all__ = ["collapsed_groups", "collapsed_fraction", "AdaptiveTemperature"]


def _pair(name: str, semantic_entropy: Tensor, accuracy: Tensor) -> tuple[Tensor, Tensor]:
    se, acc = torch.as_tensor(semantic_entropy), torch.as_tensor(accuracy)
    if se.dim() != 1 or se.shape != acc.shape or se.numel() == 0:
        raise ValueError(f"{name}: semantic_entropy {tuple(se.shape)} and accuracy {tuple(acc.shape)} must "
                         "both be [B] with B >= 1; pass one value per prompt group")
    dtype = torch.promote_types(se.dtype, torch.float32)
    return se.detach().to(dtype), acc.detach().to(device=se.device, dtype=dtype)


def collapsed_groups(semantic_entropy: Tensor, accuracy: Tensor, threshold: float = 0.1) -> Tensor:
    """[B] bool: True where ``semantic_entropy <= threshold`` and ``accuracy < 1``.

    Args:
        semantic_entropy: [B] normalised semantic entropy (SE / log G, in [0, 1]).
        accuracy: [B] fraction of each group's completions judged correct.
        threshold: the normalised SE at or below which a group's answers count as one.

    Example:
        >>> collapsed_groups(torch.tensor([0.0, 0.0, 0.05, 0.6]), torch.tensor([0.0, 1.0, 0.25, 0.0]))
        tensor([ True, False,  True, False])
    """
    se, acc = _pair("collapsed_groups", semantic_entropy, accuracy)
    return (se <= threshold) & (acc < 1)


def collapsed_fraction(semantic_entropy: Tensor, accuracy: Tensor, threshold: float = 0.1) -> Tensor:
    """Fraction of the B groups that are collapsed (see :func:`collapsed_groups`); a scalar tensor.

    Example:
        >>> collapsed_fraction(torch.tensor([0.0, 0.0, 0.05, 0.6]), torch.tensor([0.0, 1.0, 0.25, 0.0]))
        tensor(0.5000)
    """
    collapsed = collapsed_groups(semantic_entropy, accuracy, threshold)
    return collapsed.to(torch.promote_types(torch.as_tensor(semantic_entropy).dtype, torch.float32)).mean()


class AdaptiveTemperature(Callback):
    """Sampling temperature that rises when groups collapse and falls when answers scatter; a callback.

    Pass it as ``GRPOTrainer(..., entropy=SemanticEntropy(normalize=True),
    callbacks=[AdaptiveTemperature()])``: it hears every group of a step (``on_rollout``: the group's
    accuracy and normalised SE), then sets the next step's temperature (``on_step_end``, which also
    logs ``entropy/collapsed_fraction``).

    Args:
        initial: the temperature of the first step, within the bounds.
        min_temperature, max_temperature: bounds, 0 < min <= max.
        step: change per update (> 0).
        collapse_entropy: a group with normalised SE at or below this and accuracy < 1 is collapsed.
        scatter_entropy: lower the temperature when the mean normalised SE is at or above this.
        collapse_fraction: raise the temperature when more than this fraction of groups collapsed.
        accuracy_reward: the reward (breakdown name) whose group mean is the accuracy; None: the first.

    Example:
        >>> control = AdaptiveTemperature(initial=1.0, step=0.1)
        >>> control.update(torch.tensor([0.0, 0.0, 0.5]), torch.tensor([0.0, 0.0, 0.5]))  # 2/3 collapsed
        1.1
        >>> control.update(torch.tensor([0.9, 1.0]), torch.tensor([0.5, 0.0]))  # scattered
        1.0
    """

    def __init__(self, initial: float = 1.0, min_temperature: float = 0.5, max_temperature: float = 1.5,
                 step: float = 0.05, collapse_entropy: float = 0.1, scatter_entropy: float = 0.8,
                 collapse_fraction: float = 0.5, accuracy_reward: str | None = None) -> None:
        problems = []
        if not 0 < min_temperature <= max_temperature:
            problems.append(f"min_temperature={min_temperature!r}, max_temperature={max_temperature!r} must "
                            "satisfy 0 < min <= max; e.g. 0.5 and 1.5")
        elif not min_temperature <= initial <= max_temperature:
            problems.append(f"initial={initial!r} must be within [{min_temperature}, {max_temperature}]; "
                            "start from the configured sampling temperature inside the bounds")
        if not step > 0:
            problems.append(f"step={step!r} must be > 0; use e.g. 0.05")
        if not 0 <= collapse_entropy < scatter_entropy:
            problems.append(f"collapse_entropy={collapse_entropy!r}, scatter_entropy={scatter_entropy!r} "
                            "must satisfy 0 <= collapse < scatter (normalised SE); e.g. 0.1 and 0.8")
        if not 0 <= collapse_fraction < 1:
            problems.append(f"collapse_fraction={collapse_fraction!r} must be in [0, 1); e.g. 0.5")
        if problems:
            raise ValueError("invalid AdaptiveTemperature: " + "; ".join(problems))
        self.min_temperature, self.max_temperature = float(min_temperature), float(max_temperature)
        self.step, self.collapse_entropy, self.scatter_entropy = (
            float(step), collapse_entropy, scatter_entropy
        )
        self.collapse_fraction, self.accuracy_reward = collapse_fraction, accuracy_reward
        self._temperature = float(initial)
        self._seen: list[tuple[Tensor, Tensor]] = []  # (normalised SE [b], accuracy [b]) of the step's draws

    @property
    def temperature(self) -> float:
        """The temperature in force: sample (and score log-probs) at it until the next update."""
        return self._temperature

    def update(self, semantic_entropy: Tensor, accuracy: Tensor) -> float:
        """Takes one step's [B] normalised SE and accuracy; returns the temperature for the next step.

        The decision is tensor math; one conversion to a Python float at the end (the sampler
        needs a number), so it synchronises with the device once.
        """
        se, acc = _pair("AdaptiveTemperature.update", semantic_entropy, accuracy)
        collapsed = ((se <= self.collapse_entropy) & (acc < 1)).to(se.dtype).mean()
        scattered = se.mean() >= self.scatter_entropy
        direction = torch.where(collapsed > self.collapse_fraction, 1.0, torch.where(scattered, -1.0, 0.0))
        proposed = round(self._temperature + self.step * float(direction), 12)  # no drift off the step grid
        self._temperature = min(self.max_temperature, max(self.min_temperature, proposed))
        return self._temperature

    def on_init(self, trainer: Any, state: TrainerState, control: TrainerControl) -> None:
        if trainer.entropy is None:
            raise ValueError("AdaptiveTemperature needs per-group semantic entropy: pass "
                             "entropy=SemanticEntropy(normalize=True) to the trainer as well")
        # else its first update would step from another temperature
        if abs(self._temperature - trainer.config.temperature) > 1e-9:
            raise ValueError(f"AdaptiveTemperature starts at {self._temperature} but config.temperature="
                             f"{trainer.config.temperature}: pass AdaptiveTemperature(initial="
                             f"{trainer.config.temperature}, ...)")

    def on_rollout(self, trainer: Any, state: TrainerState, control: TrainerControl, *, batch: RolloutBatch,
                   rewards: RewardOutput, uncertainty: Tensor | None) -> None:
        if uncertainty is None:
            raise ValueError("AdaptiveTemperature got no per-group uncertainty; "
                             "pass entropy=SemanticEntropy(...)")
        key = self.accuracy_reward or next(iter(rewards.breakdown))
        accuracy = rewards.scored(key, f"AdaptiveTemperature(accuracy_reward={key!r})").float().mean(dim=1)
        self._seen.append((uncertainty, accuracy))

    def on_step_end(self, trainer: Any, state: TrainerState, control: TrainerControl, *,
                    metrics: dict[str, Any]) -> None:
        if not self._seen:
            return
        se = torch.cat([s for s, _ in self._seen])
        accuracy = torch.cat([a for _, a in self._seen])
        self._seen.clear()
        metrics["entropy/collapsed_fraction"] = collapsed_fraction(se, accuracy, self.collapse_entropy).item()
        trainer.set_temperature(self.update(se, accuracy))

    def state_dict(self) -> dict[str, float]:
        """``{"temperature": ...}``: the only state (the settings come from the constructor)."""
        return {"temperature": self._temperature}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the temperature; it must lie within this controller's bounds."""
        value = float(state["temperature"])
        if not self.min_temperature <= value <= self.max_temperature:
            raise ValueError(f"state temperature={value!r} is outside [{self.min_temperature}, "
                             f"{self.max_temperature}]; build the controller with the saved run's bounds")
        self._temperature = value


