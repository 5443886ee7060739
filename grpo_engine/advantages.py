"""Group-relative advantages: rewards [B, G] (G completions of each of B prompts) to advantages [B, G].

- ``GroupNormalized``: A = (r - mean_g r) / (std_g r + eps) with ``std_scope="group"`` (GRPO, arXiv
  2402.03300); ``"batch"`` divides by the std of all B * G rewards (Lite PPO, arXiv 2508.08221);
  ``"none"`` is A = r - mean_g r (Dr. GRPO, arXiv 2503.20783), the code path of ``MeanBaseline()``.
- ``RLOO`` (arXiv 2402.14740): r minus the mean of the other G - 1 rewards, = G/(G-1) · (r - mean_g r).
- ``ReinforcePlusPlusBaseline`` (REINFORCE++-baseline, arXiv 2501.03262): a = r - mean_g r, whitened
  over the B * G completions, each counted once: A = (a - mean a) / (std a + eps).
- ``MaxRL`` (Maximum Likelihood RL, arXiv 2602.02710): A = (r - mean_g r) / (mean_g r + eps) for binary
  rewards, the gradient of log pass-rate instead of pass-rate.
- ``EntropyScaled`` (SEED-GRPO, arXiv 2505.12346): a base advantage times f(strength · u_b), f
  decreasing with f(0) = 1, u_b the group's normalised semantic entropy (the ``uncertainty``).

Shared rules: mean_g and std_g are over a prompt's G rewards; every std is unbiased (n - 1), with
``eps`` (default 1e-6) added to the std; a group of equal rewards gets exactly 0; G = 1 is rejected;
"the batch" is the rewards passed in (this process's); float32, or float64 for float64 rewards; pure.
docs/algorithms.md compares these estimators with TRL, verl and OpenRLHF.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from torch import Tensor

from grpo_engine.ops import groups
from grpo_engine.ops.groups import check_eps, zero_std_fraction, zero_where
from grpo_engine.protocols import AdvantageFn

__all__ = [
    "GroupNormalized", "MeanBaseline", "RLOO", "ReinforcePlusPlusBaseline", "MaxRL", "EntropyScaled",
    "zero_std_fraction",
]

StdScope = Literal["group", "batch", "none"]


@dataclass(frozen=True)
class GroupNormalized:
    """Group-mean advantages scaled by the group std (GRPO), the batch std (Lite PPO) or nothing.

    Args:
        std_scope: ``"group"`` divides by the unbiased std of the G rewards of the group (GRPO);
            ``"batch"`` by the unbiased std of all B * G rewards (Lite PPO, TRL
            ``scale_rewards="batch"``); ``"none"`` only subtracts the group mean (Dr. GRPO, the
            same as :class:`MeanBaseline`).
        eps: >= 0, added to the std before dividing; unused with ``std_scope="none"``.

    Example:
        >>> GroupNormalized()(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
        tensor([[ 1.5000, -0.5000, -0.5000, -0.5000]])
        >>> GroupNormalized(std_scope="none")(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
        tensor([[ 0.7500, -0.2500, -0.2500, -0.2500]])
    """

    std_scope: StdScope = "group"
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.std_scope not in get_args(StdScope):
            raise ValueError(
                f"GroupNormalized: std_scope={self.std_scope!r} must be one of 'group' (GRPO), 'batch' "
                "(Lite PPO) or 'none' (Dr. GRPO); for example GroupNormalized(std_scope='group')"
            )
        check_eps(self.eps, "GroupNormalized")

    def __call__(self, rewards: Tensor, *, uncertainty: Tensor | None = None) -> Tensor:
        """Advantages of every completion relative to its group.

        Args:
            rewards: [B, G] total reward of each completion, G >= 2 (any real or integer dtype).
            uncertainty: [B] per-group uncertainty; ignored by this estimator.

        Returns:
            [B, G] advantages, float32 (float64 for float64 rewards); exact 0 in groups whose
            rewards are all equal.

        Raises:
            ValueError: if ``rewards`` is not 2-D or G < 2.
        """
        del uncertainty  # not used by this estimator
        r, advantages, equal = groups.centered(rewards, "GroupNormalized")
        if self.std_scope == "group":
            advantages = advantages / (r.std(dim=1, keepdim=True, correction=1) + self.eps)
        elif self.std_scope == "batch":
            advantages = advantages / (r.std(correction=1) + self.eps)
        return zero_where(equal, advantages)


@dataclass(frozen=True)
class MeanBaseline:
    """Dr. GRPO advantages: A_bg = r_bg - mean_g r_b (no std).

    The same computation as ``GroupNormalized(std_scope="none")``. Multiplied by G / (G - 1) it
    is the :class:`RLOO` advantage.

    Example:
        >>> MeanBaseline()(torch.tensor([[2.0, 4.0, 0.0, 2.0]]))
        tensor([[ 0.,  2., -2.,  0.]])
    """

    def __call__(self, rewards: Tensor, *, uncertainty: Tensor | None = None) -> Tensor:
        """Maps rewards [B, G] (G >= 2) to [B, G] advantages; ``uncertainty`` is ignored."""
        del uncertainty  # not used by this estimator
        _, advantages, equal = groups.centered(rewards, "MeanBaseline")
        return zero_where(equal, advantages)


@dataclass(frozen=True)
class RLOO:
    """REINFORCE leave-one-out advantages: A_bg = r_bg - mean of the other G - 1 rewards of the group.

    Example:
        >>> RLOO()(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
        tensor([[ 1.0000, -0.3333, -0.3333, -0.3333]])
    """

    def __call__(self, rewards: Tensor, *, uncertainty: Tensor | None = None) -> Tensor:
        """Maps rewards [B, G] (G >= 2) to [B, G] advantages; ``uncertainty`` is ignored.

        Raises:
            ValueError: if ``rewards`` is not 2-D or G < 2 (no other completion to average).
        """
        del uncertainty  # not used by this estimator
        if rewards.dim() == 2 and rewards.shape[1] == 1:
            raise ValueError(
                "RLOO: group_size=1 leaves no other completion for the leave-one-out baseline; "
                "use group_size >= 2"
            )
        r, _, equal = groups.centered(rewards, "RLOO")
        others_mean = (r.sum(dim=1, keepdim=True) - r) / (r.shape[1] - 1)
        return zero_where(equal, r - others_mean)


@dataclass(frozen=True)
class ReinforcePlusPlusBaseline:
    """REINFORCE++-baseline: subtract the group mean, then whiten over the B * G completions.

    A = (a - mean_batch a) / (std_batch a + eps), a_bg = r_bg - mean_g r_b, std unbiased (n = B * G).
    Each completion counts once (verl and OpenRLHF whiten tokens; docs/algorithms.md compares them).

    Args:
        eps: >= 0, added to the batch std before dividing.

    Example:
        >>> ReinforcePlusPlusBaseline(eps=0.0)(torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
        tensor([[ 1.2247, -1.2247],
                [ 0.0000,  0.0000]])
    """

    eps: float = 1e-6

    def __post_init__(self) -> None:
        check_eps(self.eps, "ReinforcePlusPlusBaseline")

    def __call__(self, rewards: Tensor, *, uncertainty: Tensor | None = None) -> Tensor:
        """Maps rewards [B, G] (G >= 2) to [B, G] advantages with batch mean 0 and batch std ~1.

        ``uncertainty`` is ignored. A group whose rewards are all equal gets exact zeros; when
        every group is like that, every advantage is 0.
        """
        del uncertainty  # not used by this estimator
        _, centered, equal = groups.centered(rewards, "ReinforcePlusPlusBaseline")
        centered = zero_where(equal, centered)
        whitened = (centered - centered.mean()) / (centered.std(correction=1) + self.eps)
        return zero_where(equal, whitened)


@dataclass(frozen=True)
class MaxRL:
    """MaxRL advantages (Tajwar et al., "Maximum Likelihood Reinforcement Learning", arXiv 2602.02710):

    A_bg = (r_bg - mean_g r_b) / (mean_g r_b + eps),

    for rewards r in [0, 1] (binary: correct or not). With K of the G completions correct, p̂ = K / G, a
    correct one gets 1/p̂ - 1 and a wrong one -1, so Σ_g A_bg ∇log π(o_bg) / G is an unbiased estimate of
    ∇log p(correct) = ∇p / p (the maximum-likelihood gradient, minus a zero-mean baseline) instead of
    GRPO's ∇p: a prompt solved 1 time in 16 pulls 16 times harder than one solved every other time,
    with no 1/std. A group that is all wrong (p̂ = 0) or all right gets exactly 0. ``eps`` (default 0,
    the paper's) only guards a group mean near 0 that is not exactly 0 (non-binary rewards).

    Args:
        eps: >= 0, added to the group mean before dividing.

    Raises:
        ValueError: a reward outside [0, 1] (the estimator is for success probabilities; rewards live on
            the host here, so the check costs no device sync in the trainer).

    Example:
        >>> MaxRL()(torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]))
        tensor([[ 3., -1., -1., -1.],
                [ 1.,  1., -1., -1.]])
    """

    eps: float = 0.0

    def __post_init__(self) -> None:
        check_eps(self.eps, "MaxRL")

    def __call__(self, rewards: Tensor, *, uncertainty: Tensor | None = None) -> Tensor:
        """Maps rewards [B, G] in [0, 1] (G >= 2) to [B, G] advantages; ``uncertainty`` is ignored."""
        del uncertainty  # not used by this estimator
        r, centered, equal = groups.centered(rewards, "MaxRL")
        if ((r < 0) | (r > 1)).any():
            raise ValueError("MaxRL: rewards must lie in [0, 1] (success indicators), and some do not; "
                             "rescale the reward (e.g. MathAccuracy alone), or use GroupNormalized()")
        mean = r.mean(dim=1, keepdim=True)
        safe = torch.where(equal, torch.ones_like(mean), mean + self.eps)  # an equal group gets 0 anyway
        return zero_where(equal, centered / safe)


_SCALINGS: dict[str, Callable[[Tensor], Tensor]] = {
    "linear": lambda x: (1.0 - x).clamp(min=0.0),
    "exponential": lambda x: torch.exp(-x),
    "inverse": lambda x: 1.0 / (1.0 + x),
}


@dataclass(frozen=True)
class EntropyScaled:
    """SEED-GRPO-style advantages: a base advantage scaled down by each group's semantic uncertainty.

    A_bg = base(rewards)_bg * f(strength * u_b), with u [B] the normalised uncertainty passed by
    the trainer (``SemanticEntropy(normalize=True)``, in [0, 1]) and f decreasing with f(0) = 1,
    so a group with u = 0 keeps its base advantage exactly. Built-in f:

    * ``"linear"``: f(x) = max(1 - x, 0); clipped at 0 so that strength * u > 1 switches the group
      off rather than flipping the sign of its advantages.
    * ``"exponential"``: f(x) = exp(-x).
    * ``"inverse"``: f(x) = 1 / (1 + x), the form of the third-party SEED-GRPO reproduction
      (``maxent_grpo``: scale 1 / (1 + alpha * SE / ln G)).

    The paper (Chen et al. 2025, arXiv 2505.12346) is summarised as A_i * f(alpha * SE / SE_max)
    with "linear", "exponential" and "focal" variants of f; their exact parameterisations, and the
    official alpha, were not verified (FIELD_NOTES A.14), so these built-ins are our choices, and
    "focal" is not provided (pass a callable). The paper's base is Dr. GRPO's mean-only
    advantage: ``EntropyScaled(base=MeanBaseline())``.

    Args:
        base: the advantage to scale (any ``AdvantageFn``); it receives the same ``uncertainty``.
        strength: >= 0, the sensitivity (alpha); 0 gives the base advantage unchanged.
        fn: ``"linear"``, ``"exponential"``, ``"inverse"``, or a callable mapping x [B] to
            factors [B] (elementwise, decreasing, f(0) = 1 expected).

    Example:
        >>> adv = EntropyScaled(base=MeanBaseline(), strength=1.0, fn="linear")
        >>> adv(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), uncertainty=torch.tensor([0.0, 0.25]))
        tensor([[ 0.5000, -0.5000],
                [ 0.3750, -0.3750]])
    """

    base: AdvantageFn = field(default_factory=GroupNormalized)
    strength: float = 1.0
    fn: Callable[[Tensor], Tensor] | str = "linear"

    def __post_init__(self) -> None:
        s = self.strength
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s < float("inf"):
            raise ValueError(f"EntropyScaled: strength={s!r} must be a finite number >= 0; "
                             "for example strength=1.0")
        if isinstance(self.fn, str) and self.fn not in _SCALINGS:
            raise ValueError(f"EntropyScaled: fn={self.fn!r} must be one of {sorted(_SCALINGS)} "
                             "or a callable mapping Tensor -> Tensor; for example fn='linear'")
        if not isinstance(self.fn, str) and not callable(self.fn):
            raise ValueError(f"EntropyScaled: fn={self.fn!r} must be a name in {sorted(_SCALINGS)} "
                             "or a callable")

    def __call__(self, rewards: Tensor, *, uncertainty: Tensor | None = None) -> Tensor:
        """Base advantages [B, G] times the per-group factor f(strength * uncertainty) [B].

        Args:
            rewards: [B, G] total reward of each completion.
            uncertainty: [B] normalised uncertainty, expected in [0, 1] (not checked: that would
                need a device sync).

        Returns:
            [B, G] advantages in the base advantages' dtype.

        Raises:
            ValueError: if ``uncertainty`` is None or not shaped [B], or ``fn`` returns another shape.
        """
        if uncertainty is None:
            raise ValueError(
                "EntropyScaled needs a per-group uncertainty but got None; pass "
                "entropy=SemanticEntropy(normalize=True) (from grpo_engine.entropy) to the trainer"
            )
        if rewards.dim() != 2 or tuple(uncertainty.shape) != (rewards.shape[0],):
            raise ValueError(
                f"EntropyScaled: uncertainty shape {tuple(uncertainty.shape)} must be "
                f"[B]=({rewards.shape[0]},) for rewards of shape {tuple(rewards.shape)} [B, G]: "
                "one value per prompt"
            )
        advantages = self.base(rewards, uncertainty=uncertainty)
        f = _SCALINGS[self.fn] if isinstance(self.fn, str) else self.fn
        factor = f(self.strength * uncertainty.to(device=advantages.device, dtype=advantages.dtype))
        if tuple(factor.shape) != (rewards.shape[0],):
            raise ValueError(f"EntropyScaled: fn returned shape {tuple(factor.shape)}; "
                             "it must map x [B] to [B] elementwise")
        return advantages * factor.unsqueeze(1)
