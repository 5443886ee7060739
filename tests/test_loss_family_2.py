"""Issue 53, second part: GDPO, MaxRL, the off-policy sequence mask, two-sided importance sampling, ...
Each against a naive float64 loop written from its paper and, where TRL 1.16 has it, against TRL's own code
on the same inputs."""

import inspect
import math
import textwrap

import pytest
import torch

from grpo_engine.advantages import ReinforcePlusPlusBaseline
from grpo_engine.rewards import WeightedSum
from tests.test_rewards import Fixed, Q, make_batch

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")


# -- GDPO: each reward z-scored within its group, then summed, then whitened over the batch --------------

def trl_normalize_then_sum(rewards_per_func, weights, num_generations):
    """TRL 1.16's own ``multi_objective_aggregation="normalize_then_sum"`` lines, cut out of
    ``GRPOTrainer._generate_and_score_completions`` by their source and run on [N, K] rewards."""
    source = textwrap.dedent(inspect.getsource(trl_grpo.GRPOTrainer._generate_and_score_completions))
    start = source.index('elif self.multi_objective_aggregation == "normalize_then_sum":')
    indent = start - source.rindex("\n", 0, start) - 1
    body = source[start:source.index("\n" + " " * indent + "else:", start)].split("\n", 1)[1]
    scope = dict(rewards_per_func=rewards_per_func, num_generations=num_generations, torch=torch,
                 nanstd=trl_grpo.nanstd, device=rewards_per_func.device,
                 unscorable_mask=torch.isnan(rewards_per_func).all(dim=1),
                 self=type("S", (), dict(reward_funcs=[None] * rewards_per_func.shape[1],
                                         reward_weights=weights))())
    exec(textwrap.dedent(body), scope)  # noqa: S102 - TRL's installed code, to compare with it
    return scope["advantages"]


def gdpo_reference(scores, weights, group_size, eps):
    """GDPO, arXiv 2601.05242: z_k = (s_k - mean_g s_k)/(std_g s_k + eps) per reward k and group g (unbiased
    std), t = Σ_k w_k z_k, A = (t - mean t)/(std t + eps) over the batch. Loops, float64."""
    n, k = len(scores), len(weights)
    t = [0.0] * n
    for j in range(k):
        for start in range(0, n, group_size):
            g = [scores[i][j] for i in range(start, start + group_size)]
            mean = sum(g) / group_size
            std = math.sqrt(sum((x - mean) ** 2 for x in g) / (group_size - 1))
            for i in range(start, start + group_size):
                t[i] += weights[j] * (scores[i][j] - mean) / (std + eps)
    mean = sum(t) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in t) / (n - 1))
    return torch.tensor([(x - mean) / (std + eps) for x in t], dtype=torch.float64)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("group_size", [2, 4])
def test_gdpo_equals_trl_normalize_then_sum(seed, group_size):
    """WeightedSum(normalize='each', eps=1e-4) + ReinforcePlusPlusBaseline(eps=1e-4) is TRL's
    'normalize_then_sum': the same advantages as TRL's own lines and the float64 loop (float32 rewards),
    a reward constant in one group included; the default eps 1e-6 differs from TRL only by the eps."""
    gen = torch.Generator().manual_seed(seed)
    b, k = 3, 3
    scores = torch.stack([torch.randint(0, 2, (b * group_size,), generator=gen).double(),
                          torch.rand(b * group_size, generator=gen, dtype=torch.float64) * 50,
                          torch.randn(b * group_size, generator=gen, dtype=torch.float64)], dim=1)
    scores[:group_size, 0] = 1.0  # the binary reward is equal in the first group: it adds 0 there
    weights = torch.tensor([1.0, 0.5, -0.2], dtype=torch.float64)
    rewards = [Fixed(f"r{j}", scores[:, j].tolist(), weight=weights[j].item()) for j in range(k)]
    batch = make_batch([Q] * b, ["x"] * (b * group_size), group_size=group_size)
    total = WeightedSum(rewards, normalize="each", eps=1e-4)(batch).total
    ours = ReinforcePlusPlusBaseline(eps=1e-4)(total).flatten().double()
    trl = trl_normalize_then_sum(scores, weights, group_size)
    torch.testing.assert_close(ours, trl, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours, gdpo_reference(scores.tolist(), weights.tolist(), group_size, 1e-4),
                               rtol=1e-5, atol=1e-5)
    default = ReinforcePlusPlusBaseline()(WeightedSum(rewards, normalize="each")(batch).total).flatten()
    torch.testing.assert_close(default.double(), gdpo_reference(scores.tolist(), weights.tolist(), group_size,
                                                                1e-6), rtol=1e-5, atol=1e-5)


def test_weighted_sum_eps_is_checked_and_shown():
    with pytest.raises(ValueError, match=r"WeightedSum: eps=-1.0 must be >= 0"):
        WeightedSum([Fixed("a", [1.0])], eps=-1.0)
    assert repr(WeightedSum([Fixed("a", [1.0])], normalize="each", eps=1e-4)).endswith(
        "normalize='each', eps=0.0001)")


# -- MaxRL ---------------------------------------------------------------------------------------------

def maxrl_reference(rewards, eps=0.0):
    """MaxRL, arXiv 2602.02710: p = mean of the group; A = (r - p)/(p + eps); 0 when the group is equal."""
    out = []
    for group in rewards:
        p = sum(group) / len(group)
        equal = all(x == group[0] for x in group)
        out.append([0.0 if equal else (x - p) / (p + eps) for x in group])
    return torch.tensor(out, dtype=torch.float64)


def test_maxrl_hand_values():
    """G = 4. One right of 4: p = 1/4, the right one (1 - 1/4)/(1/4) = 3, the wrong ones -1. Two right:
    p = 1/2, +1 and -1. All wrong or all right: 0 (no signal, no division by 0). GRPO would give the rare
    success 1.5 (z-score), MaxRL twice that: the likelihood gradient ∇p/p up-weights hard prompts."""
    from grpo_engine.advantages import MaxRL

    got = MaxRL()(torch.tensor([[1.0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]))
    assert got.tolist() == [[3.0, -1, -1, -1], [1, 1, -1, -1], [0, 0, 0, 0], [0, 0, 0, 0]]
    # Σ_g A_g = G·(p - p)/p = 0: a baseline, so the expected gradient is unbiased
    assert got.sum(dim=1).abs().max() == 0


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("eps", [0.0, 1e-3])
def test_maxrl_matches_naive_reference(seed, eps):
    from grpo_engine.advantages import MaxRL

    gen = torch.Generator().manual_seed(seed)
    binary = torch.randint(0, 2, (6, 8), generator=gen).double()
    binary[0], binary[1] = 0.0, 1.0  # an all-wrong and an all-right group
    binary[2] = torch.tensor([1.0] + [0.0] * 7)  # one success in 8: advantage 7
    fractional = torch.rand(3, 5, generator=gen, dtype=torch.float64)  # rewards in [0, 1], not binary
    for rewards in (binary, fractional):
        got = MaxRL(eps=eps)(rewards)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, maxrl_reference(rewards.tolist(), eps), rtol=1e-12, atol=1e-12)
    assert MaxRL()(binary)[2, 0].item() == 7.0


def test_maxrl_refuses_rewards_outside_unit_interval_and_single_completions():
    from grpo_engine.advantages import MaxRL

    with pytest.raises(ValueError, match=r"MaxRL: rewards must lie in \[0, 1\]"):
        MaxRL()(torch.tensor([[1.0, -1.0]]))
    with pytest.raises(ValueError, match=r"MaxRL: group_size=1"):
        MaxRL()(torch.tensor([[1.0]]))
    with pytest.raises(ValueError, match=r"MaxRL: eps=-0.1 must be >= 0"):
        MaxRL(eps=-0.1)
