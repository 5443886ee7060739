"""Numbers for the group-relative advantages (grpo_engine.advantages)."""

import dataclasses
import math
import statistics

import pytest
import torch

from grpo_engine.advantages import (
    RLOO,
    GroupNormalized,
    MeanBaseline,
    ReinforcePlusPlusBaseline,
    zero_std_fraction,
)
from grpo_engine.protocols import AdvantageFn

ALL = [GroupNormalized(), GroupNormalized(std_scope="batch"), MeanBaseline(), RLOO(),
       ReinforcePlusPlusBaseline()]
IDS = ["group", "batch", "mean", "rloo", "rpp"]


# --- naive fp64 references, one Python loop per formula ---------------------------------


def ref_group(rows, scope, eps=1e-6):
    flat = [r for row in rows for r in row]
    batch_std = statistics.stdev(flat)  # Bessel-corrected
    out = []
    for row in rows:
        mean, std = statistics.fmean(row), statistics.stdev(row)
        scale = {"group": std + eps, "batch": batch_std + eps, "none": 1.0}[scope]
        out.append([(r - mean) / scale if std else 0.0 for r in row])
    return out


def ref_rloo(rows):
    g = len(rows[0])
    return [[r - (sum(row) - r) / (g - 1) for r in row] for row in rows]


def ref_rpp(rows, eps=1e-6):
    centred = [[r - statistics.fmean(row) for r in row] for row in rows]
    flat = [a for row in centred for a in row]
    mean, std = statistics.fmean(flat), statistics.stdev(flat)
    return [
        [(a - mean) / (std + eps) if statistics.stdev(row) else 0.0 for a in crow]
        for row, crow in zip(rows, centred)
    ]


def random_rewards(b=6, g=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b, g, generator=gen, dtype=torch.float64)
    rewards[1] = 0.5  # all equal
    rewards[2] = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])[:g]  # binary verifier rewards
    return rewards


# --- GroupNormalized ---------------------------------------------------------------------


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
    torch.testing.assert_close(GroupNormalized(std_scope="none")(rewards), want)
    torch.testing.assert_close(MeanBaseline()(rewards), want)


def test_batch_std_hand_values():
    """Rewards [[3, 0, 0], [0, 0, 0], [0, 0, 0]]. Batch: mean 1/3, sum of squares 9 - 9·(1/3)² = 8,
    unbiased variance 8/8 = 1, std 1 -> first group (3-1, 0-1, 0-1)/1 = [2, -1, -1], others 0.
    Group: first group deviations [2, -1, -1], variance 6/2 = 3 -> [2, -1, -1]/√3."""
    rewards = torch.tensor([[3.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    batch = GroupNormalized(std_scope="batch", eps=0.0)(rewards)
    torch.testing.assert_close(batch, torch.tensor([[2.0, -1.0, -1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    group = GroupNormalized(std_scope="group", eps=0.0)(rewards)
    torch.testing.assert_close(group[0], torch.tensor([2.0, -1.0, -1.0]) / math.sqrt(3))


def test_batch_std_is_one_number_for_all_groups():
    """Batch scope divides every group by the same std, so batch / mean-only is one constant,
    1 / (std of all B·G rewards + eps); with one prompt the batch is the group."""
    rewards = random_rewards()
    batch = GroupNormalized(std_scope="batch")(rewards)
    ratio = batch[batch != 0] / MeanBaseline()(rewards)[batch != 0]
    torch.testing.assert_close(ratio, torch.full_like(ratio, 1.0 / (rewards.std().item() + 1e-6)))
    one = rewards[:1]
    torch.testing.assert_close(GroupNormalized(std_scope="batch")(one), GroupNormalized()(one))


@pytest.mark.parametrize("scope", ["group", "batch", "none"])
def test_group_normalized_matches_fp64_reference(scope):
    rewards = random_rewards()
    want = torch.tensor(ref_group(rewards.tolist(), scope), dtype=torch.float64)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        adv = GroupNormalized(std_scope=scope)(rewards.to(dtype))
        assert adv.dtype == dtype
        torch.testing.assert_close(adv.double(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(adv.sum(1).double(), torch.zeros(6, dtype=torch.float64), rtol=0, atol=tol)


def test_mean_baseline_is_group_normalized_without_std():
    rewards = random_rewards(seed=3).float()
    assert torch.equal(MeanBaseline()(rewards), GroupNormalized(std_scope="none")(rewards))


def test_integer_rewards_and_ignored_uncertainty():
    rewards = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0]])
    fn = GroupNormalized(eps=0.0)
    adv = fn(rewards)
    assert adv.dtype == torch.float32
    # second group: mean 0.5, unbiased std sqrt(1/3) -> ±0.5·sqrt(3) = ±0.8660
    torch.testing.assert_close(adv[1], torch.tensor([0.8660254, 0.8660254, -0.8660254, -0.8660254]))
    for fn in ALL:
        assert torch.equal(fn(rewards, uncertainty=torch.tensor([3.0, 0.1])), fn(rewards))


# --- RLOO --------------------------------------------------------------------------------


def test_rloo_hand_values():
    """[1, 0, 0, 0]: 1 - mean(0, 0, 0) = 1; 0 - mean(1, 0, 0) = -1/3.
    [2, 4, 0, 2]: 2 - 6/3 = 0; 4 - 4/3 = 8/3; 0 - 8/3; 2 - 6/3 = 0."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 4.0, 0.0, 2.0]])
    want = torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3], [0.0, 8 / 3, -8 / 3, 0.0]])
    torch.testing.assert_close(RLOO()(rewards), want)


def test_rloo_is_mean_baseline_times_g_over_g_minus_1():
    """Dr. GRPO App. A: (G / (G - 1)) · (r - mean r) == r - mean of the others."""
    for g in (2, 3, 8):
        rewards = torch.randn(5, g, generator=torch.Generator().manual_seed(g), dtype=torch.float64)
        torch.testing.assert_close(RLOO()(rewards), g / (g - 1) * MeanBaseline()(rewards), rtol=1e-12,
                                   atol=1e-12)


def test_rloo_matches_fp64_reference():
    rewards = random_rewards()
    want = torch.tensor(ref_rloo(rewards.tolist()), dtype=torch.float64)
    torch.testing.assert_close(RLOO()(rewards), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(RLOO()(rewards.float()).double(), want, rtol=1e-5, atol=1e-5)


# --- REINFORCE++-baseline ----------------------------------------------------------------


def test_reinforce_pp_baseline_hand_values():
    """Rewards [[1, 0, 0, 0], [1, 1, 0, 0]] minus group means 0.25 and 0.5:
    [[0.75, -0.25, -0.25, -0.25], [0.5, 0.5, -0.5, -0.5]]; batch mean 0; sum of squares
    0.5625 + 3·0.0625 + 4·0.25 = 1.75, unbiased variance 1.75/7 = 0.25, std 0.5
    -> [[1.5, -0.5, -0.5, -0.5], [1, 1, -1, -1]]."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    want = torch.tensor([[1.5, -0.5, -0.5, -0.5], [1.0, 1.0, -1.0, -1.0]])
    torch.testing.assert_close(ReinforcePlusPlusBaseline(eps=0.0)(rewards), want)


def test_reinforce_pp_baseline_batch_mean_0_std_1():
    for seed in range(3):
        rewards = random_rewards(b=16, g=4, seed=seed)
        adv = ReinforcePlusPlusBaseline(eps=0.0)(rewards)
        torch.testing.assert_close(adv.mean(), torch.tensor(0.0, dtype=torch.float64), rtol=0, atol=1e-12)
        torch.testing.assert_close(adv.std(), torch.tensor(1.0, dtype=torch.float64), rtol=1e-12, atol=0)
        adv32 = ReinforcePlusPlusBaseline()(rewards.float())  # default eps: std = s / (s + 1e-6)
        assert abs(adv32.mean().item()) < 1e-6 and adv32.std().item() == pytest.approx(1.0, abs=1e-5)


def test_reinforce_pp_baseline_matches_fp64_reference_and_invariances():
    rewards = random_rewards()
    want = torch.tensor(ref_rpp(rewards.tolist()), dtype=torch.float64)
    torch.testing.assert_close(ReinforcePlusPlusBaseline()(rewards), want, rtol=1e-12, atol=1e-12)
    # robust to the reward scale: a global affine map a·r + c (a > 0) changes nothing (eps 0)
    fn = ReinforcePlusPlusBaseline(eps=0.0)
    torch.testing.assert_close(fn(7.0 * rewards - 3.0), fn(rewards), rtol=1e-10, atol=1e-10)
    # one prompt: the batch is the group, so it is the group z-score
    torch.testing.assert_close(fn(rewards[:1]), GroupNormalized(eps=0.0)(rewards[:1]))


# --- shared behaviour --------------------------------------------------------------------


@pytest.mark.parametrize("fn", ALL + [GroupNormalized(eps=0.0), ReinforcePlusPlusBaseline(eps=0.0)])
def test_equal_groups_are_exactly_zero(fn):
    """Eight rewards of 0.1 in float32 have a mean that is off by 7e-9 and a std of 8e-9, so a
    plain z-score gives ≈ -0.93 (eps 0) or ≈ -0.007 (eps 1e-6); the group must give exact zeros."""
    rewards = torch.tensor([[0.1] * 8, [1.0] * 8, [0.0] * 8, [0.0] * 7 + [1.0]])
    adv = fn(rewards)
    assert torch.equal(adv[:3], torch.zeros(3, 8))
    assert (adv[3] != 0).all()
    assert torch.equal(fn(torch.full((3, 4), 0.7)), torch.zeros(3, 4))  # every group equal: no NaN


@pytest.mark.parametrize("fn", ALL, ids=IDS)
def test_shapes_and_dtypes(fn):
    for dtype, want in ((torch.int64, torch.float32), (torch.bfloat16, torch.float32),
                        (torch.float64, torch.float64)):
        adv = fn(torch.tensor([[1, 0, 0], [2, 0, 1]]).to(dtype))
        assert adv.shape == (2, 3) and adv.dtype == want


@pytest.mark.parametrize("fn", ALL, ids=IDS)
def test_group_size_1_and_flat_rewards_are_errors(fn):
    name = type(fn).__name__
    with pytest.raises(ValueError, match=rf"{name}: group_size=1 .*use group_size >= 2"):
        fn(torch.ones(4, 1))
    with pytest.raises(ValueError, match=rf"{name}: rewards shape \(8,\) must be 2-D \[B, G\]"):
        fn(torch.ones(8))


def test_errors_name_the_value_and_fix():
    with pytest.raises(ValueError, match=r"group_size=1 makes every advantage 0; use group_size >= 2"):
        GroupNormalized()(torch.ones(4, 1))
    with pytest.raises(ValueError, match=r"RLOO: group_size=1 leaves no other completion"):
        RLOO()(torch.ones(4, 1))
    with pytest.raises(ValueError, match=r"eps=-1.0 must be >= 0"):
        GroupNormalized(eps=-1.0)
    with pytest.raises(ValueError, match=r"ReinforcePlusPlusBaseline: eps=nan must be >= 0"):
        ReinforcePlusPlusBaseline(eps=float("nan"))
    with pytest.raises(ValueError, match=r"std_scope='global' must be one of 'group' \(GRPO\), 'batch'"):
        GroupNormalized(std_scope="global")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"must be 2-D \[B, G\] with B >= 1"):
        zero_std_fraction(torch.ones(8))


def test_zero_std_fraction():
    """Groups [1,1] [0,1] [0,0] [0.5,0.5]: three of four have equal rewards -> 0.75."""
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.5, 0.5]])
    frac = zero_std_fraction(rewards)
    assert frac.shape == () and frac.item() == 0.75
    assert zero_std_fraction(torch.tensor([[0, 1, 1]])).item() == 0.0


@pytest.mark.parametrize("fn", ALL, ids=IDS)
def test_protocol_and_frozen(fn):
    assert isinstance(fn, AdvantageFn)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fn.eps = 0.1  # type: ignore[misc]
