"""Numbers for the group-relative advantages (grpo_engine.advantages)."""

import dataclasses
import statistics

import pytest
import torch

from grpo_engine.advantages import GroupNormalized, zero_std_fraction
from grpo_engine.protocols import AdvantageFn


def test_z_score_hand_values():
    """Rewards [1, 0, 0, 0]: mean 0.25; deviations [0.75, -0.25, -0.25, -0.25];
    unbiased variance (0.5625 + 3·0.0625)/3 = 0.25, std 0.5 -> [1.5, -0.5, -0.5, -0.5].
    (The biased std would be 0.433 and give [1.732, -0.577, ...].)"""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(GroupNormalized(eps=0.0)(rewards), torch.tensor([[1.5, -0.5, -0.5, -0.5]]))
    # default eps=1e-6 is added to the std: 0.75 / 0.500001
    assert GroupNormalized()(rewards)[0, 0].item() == pytest.approx(0.75 / (0.5 + 1e-6), rel=1e-6)


def test_mean_only_hand_values():
    """Dr. GRPO: rewards [1, 0, 0, 0] and [2, 4, 0, 2] minus their means 0.25 and 2."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 4.0, 0.0, 2.0]])
    want = torch.tensor([[0.75, -0.25, -0.25, -0.25], [0.0, 2.0, -2.0, 0.0]])
    torch.testing.assert_close(GroupNormalized(scale_by_std=False)(rewards), want)


@pytest.mark.parametrize("scale_by_std", [True, False])
@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_zero_std_groups_are_exactly_zero(scale_by_std, eps):
    """Eight rewards of 0.1 in float32 have a mean that is off by 7e-9 and a std of 8e-9, so a
    plain z-score gives ≈ -0.93 (eps 0) or ≈ -0.007 (eps 1e-6); the group must give exact zeros."""
    rewards = torch.tensor([[0.1] * 8, [1.0] * 8, [0.0] * 8, [0.0] * 7 + [1.0]])
    adv = GroupNormalized(scale_by_std=scale_by_std, eps=eps)(rewards)
    assert torch.equal(adv[:3], torch.zeros(3, 8))
    assert (adv[3] != 0).all()


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_matches_fp64_reference(scale_by_std):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(6, 5, generator=g, dtype=torch.float64)
    rewards[1] = 0.5  # all equal
    rewards[2] = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])  # binary verifier rewards
    eps = 1e-6
    want = []
    for group in rewards.tolist():
        mean, std = statistics.fmean(group), statistics.stdev(group)  # stdev is Bessel-corrected
        want.append([((r - mean) / (std + eps) if scale_by_std else r - mean) if std else 0.0 for r in group])
    want = torch.tensor(want, dtype=torch.float64)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        adv = GroupNormalized(scale_by_std=scale_by_std, eps=eps)(rewards.to(dtype))
        assert adv.dtype == dtype
        torch.testing.assert_close(adv.double(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(adv.sum(1).double(), torch.zeros(6, dtype=torch.float64), rtol=0, atol=tol)


def test_integer_rewards_and_ignored_uncertainty():
    rewards = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0]])
    fn = GroupNormalized(eps=0.0)
    adv = fn(rewards)
    assert adv.dtype == torch.float32
    # second group: mean 0.5, unbiased std sqrt(1/3) -> ±0.5·sqrt(3) = ±0.8660
    torch.testing.assert_close(adv[1], torch.tensor([0.8660254, 0.8660254, -0.8660254, -0.8660254]))
    assert torch.equal(fn(rewards, uncertainty=torch.tensor([3.0, 0.1])), adv)


def test_errors_name_the_value_and_fix():
    with pytest.raises(ValueError, match=r"group_size=1 makes every advantage 0; use group_size >= 2"):
        GroupNormalized()(torch.ones(4, 1))
    with pytest.raises(ValueError, match=r"rewards shape \(8,\) must be 2-D \[B, G\]"):
        GroupNormalized()(torch.ones(8))
    with pytest.raises(ValueError, match=r"eps=-1.0 must be >= 0"):
        GroupNormalized(eps=-1.0)
    with pytest.raises(ValueError, match=r"must be 2-D \[B, G\] with B >= 1"):
        zero_std_fraction(torch.ones(8))


def test_zero_std_fraction():
    """Groups [1,1] [0,1] [0,0] [0.5,0.5]: three of four have equal rewards -> 0.75."""
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.5, 0.5]])
    frac = zero_std_fraction(rewards)
    assert frac.shape == () and frac.item() == 0.75
    assert zero_std_fraction(torch.tensor([[0, 1, 1]])).item() == 0.0


def test_protocol_and_frozen():
    assert isinstance(GroupNormalized(), AdvantageFn)
    with pytest.raises(dataclasses.FrozenInstanceError):
        GroupNormalized().eps = 0.1  # type: ignore[misc]
