"""Group-relative advantages: one scalar per completion from the rewards of its group.

Every estimator maps rewards [B, G] (B prompts, G completions each) to advantages [B, G]; the
loss broadcasts a completion's advantage to all of its tokens. Notation: r_bg is the reward of
completion g of prompt b, mean_g and std_g are taken over the G rewards of prompt b, and "the
batch" is the B * G rewards passed in (one step; under data parallelism, the rewards of this
process unless the caller gathers them).

``GroupNormalized(std_scope=...)`` subtracts the group mean and divides by a std + ``eps``:

* ``"group"`` (default): A_bg = (r_bg - mean_g r_b) / (std_g r_b + eps), the outcome-supervision
  advantage of GRPO (DeepSeekMath, Shao et al. 2024, arXiv 2402.03300).
* ``"batch"``: A_bg = (r_bg - mean_g r_b) / (std(all B * G rewards) + eps): group mean, batch std,
  as in Lite PPO (Liu et al. 2025, arXiv 2508.08221) and TRL ``scale_rewards="batch"`` (TRL takes
  the std of the raw rewards of the whole batch, as here, and uses eps = 1e-4).
* ``"none"``: A_bg = r_bg - mean_g r_b, the mean-only advantage of Dr. GRPO (Liu et al. 2025,
  arXiv 2503.20783), which removes the 1/std up-weighting of too easy and too hard prompts.
  ``MeanBaseline()`` is the same computation under its paper name (one code path, equal bits).

``RLOO`` (Kool et al. 2019; Ahmadian et al. 2024, arXiv 2402.14740) subtracts the mean of the
*other* G - 1 rewards: A_bg = r_bg - sum_{j != g} r_bj / (G - 1) = G / (G - 1) * (r_bg - mean_g r_b),
so it is Dr. GRPO's advantage times the constant G / (G - 1).

``ReinforcePlusPlusBaseline`` (REINFORCE++-baseline, Hu 2025, arXiv 2501.03262; OpenRLHF
``reinforce_baseline``, verl ``reinforce_plus_plus_baseline``) subtracts the group mean, then
whitens over the batch: A = (a - mean_batch a) / (std_batch a + eps) with a_bg = r_bg - mean_g r_b.
We whiten the B * G *completions*, each weighted equally. With equal group sizes mean_batch a is 0
up to rounding, so the output is the group-centred reward divided by its batch std.
verl tiles each advantage over the completion's tokens and whitens the tokens (``masked_whiten``:
token-weighted mean, Bessel-corrected variance over the token count, scale 1/sqrt(var + 1e-8));
OpenRLHF also whitens tokens, with the biased variance and 1/sqrt(max(var, 1e-8)). Token
whitening weights a completion by its length, so long completions dominate the statistics, and
its mean is not 0: a group whose rewards are all equal then gets the nonzero advantage
-mean_tok / std_tok there, and exactly 0 here. With equal lengths L the two agree except for the
Bessel factor (N / (N - 1) here, N L / (N L - 1) in verl, N = B * G) and the place of eps.

``EntropyScaled`` (SEED-GRPO, Chen et al. 2025, arXiv 2505.12346) multiplies a base advantage
(``GroupNormalized()`` by default) by a decreasing function of the group's normalised semantic
entropy u in [0, 1]: A_bg = base(r)_bg * f(strength * u_b), so uncertain prompts get smaller
updates and confident ones keep (close to) the full signal; see its docstring for the choices of f.

Choices shared by all estimators:

* every std is the unbiased one (Bessel, divide by n - 1), as ``torch.std``, TRL and verl use;
  ``eps`` (default 1e-6, verl's group value) is added to the std, never to the variance;
* a group whose G rewards are all equal gets advantage exactly 0, whatever rounding the mean
  has: it carries no learning signal (for the batch-whitened estimator this is what the math
  gives, since the batch mean of the centred rewards is 0);
* G = 1 is rejected (every advantage would be 0; RLOO's baseline is undefined), unlike verl's
  mean 0 / std 1 fallback;
* ``uncertainty`` is accepted for the ``AdvantageFn`` protocol and ignored (except by ``EntropyScaled``);
* computation is in float32, or float64 for float64 rewards. Pure: no ``.item()``, no logging.
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
    "GroupNormalized", "MeanBaseline", "RLOO", "ReinforcePlusPlusBaseline", "EntropyScaled", "zero_std_fraction",
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
    Each completion counts once (verl and OpenRLHF whiten tokens; see the module docstring).

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
            raise ValueError(f"EntropyScaled: strength={s!r} must be a finite number >= 0; for example strength=1.0")
        if isinstance(self.fn, str) and self.fn not in _SCALINGS:
            raise ValueError(f"EntropyScaled: fn={self.fn!r} must be one of {sorted(_SCALINGS)} or a callable "
                             "mapping Tensor -> Tensor; for example fn='linear'")
        if not isinstance(self.fn, str) and not callable(self.fn):
            raise ValueError(f"EntropyScaled: fn={self.fn!r} must be a name in {sorted(_SCALINGS)} or a callable")

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
                f"EntropyScaled: uncertainty shape {tuple(uncertainty.shape)} must be [B]=({rewards.shape[0]},) "
                f"for rewards of shape {tuple(rewards.shape)} [B, G]: one value per prompt"
            )
        advantages = self.base(rewards, uncertainty=uncertainty)
        f = _SCALINGS[self.fn] if isinstance(self.fn, str) else self.fn
        factor = f(self.strength * uncertainty.to(device=advantages.device, dtype=advantages.dtype))
        if tuple(factor.shape) != (rewards.shape[0],):
            raise ValueError(f"EntropyScaled: fn returned shape {tuple(factor.shape)}; it must map x [B] to [B] "
                             "elementwise")
        return advantages * factor.unsqueeze(1)
