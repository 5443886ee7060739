"""Semantic entropy (clustering, discrete, likelihood, correctness-aware) and EntropyScaled, by hand."""

import dataclasses
import math

import pytest
import torch

from grpo_engine.advantages import EntropyScaled, GroupNormalized, MeanBaseline
from grpo_engine.entropy import SemanticEntropy, cluster_answers, semantic_entropy, sequence_log_likelihood
from grpo_engine.protocols import AdvantageFn, EntropyEstimator
from grpo_engine.types import Prompt, Requirements, RewardOutput, RolloutBatch

LN = math.log
HALVES = ("<answer>1/2</answer>", "<answer>0.5</answer>", r"so \boxed{\frac{1}{2}}", "<answer>3</answer>")
H_3_1 = -(0.75 * LN(0.75) + 0.25 * LN(0.25))  # 0.5623: clusters of 3 and 1 among 4
H_2_1 = -(2 / 3 * LN(2 / 3) + 1 / 3 * LN(1 / 3))  # 0.6365: clusters of 2 and 1 among 3
H_08_02 = -(0.8 * LN(0.8) + 0.2 * LN(0.2))  # 0.5004


def make_batch(groups, logprobs=None, mask=None):
    """B groups of G completion texts; optional [N, C] sampler log-probs and completion mask."""
    b, g = len(groups), len(groups[0])
    n = b * g
    c = 1 if logprobs is None else logprobs.shape[1]
    mask = torch.ones(n, c, dtype=torch.bool) if mask is None else mask
    return RolloutBatch(
        prompts=tuple(Prompt(f"q{i}", "0.5") for i in range(b)), group_size=g,
        prompt_ids=torch.zeros(n, 2, dtype=torch.long), prompt_mask=torch.ones(n, 2, dtype=torch.bool),
        completion_ids=torch.zeros(n, c, dtype=torch.long), completion_mask=mask,
        is_truncated=torch.zeros(n, dtype=torch.bool), texts=tuple(t for grp in groups for t in grp),
        sampler_logprobs=logprobs,
    )


def rewards_of(total, **breakdown):
    return RewardOutput(total=torch.tensor(total, dtype=torch.float32),
                        breakdown={k: torch.tensor(v, dtype=torch.float32) for k, v in breakdown.items()})


def zeros(b, g):
    return rewards_of([[0.0] * g] * b)


# -- clustering ----------------------------------------------------------------------------------


def test_equivalent_forms_cluster_together_and_none_is_always_alone():
    assert cluster_answers(["1/2", "0.5", r"\frac{1}{2}", "3"]) == [0, 0, 0, 1]
    assert cluster_answers([None, "3", None, "3.0", None]) == [0, 1, 2, 1, 3]
    assert cluster_answers([None, None, None]) == [0, 1, 2]
    assert cluster_answers(["1,000", "1000", r"\boxed{1000}", "x = 1000"]) == [0, 0, 0, 0]
    assert cluster_answers([]) == []


def test_equivalence_must_hold_in_both_directions():
    # "gold" a is equal to b when b starts with a: holds for ("ab", "abc") but not ("abc", "ab")
    prefix = lambda a, b: b.startswith(a)
    assert cluster_answers(["ab", "abc"], equal=prefix) == [0, 1]
    # same string always matches
    assert cluster_answers(["ab", "ab", "x"], equal=lambda a, b: False) == [0, 0, 1]
    calls = []
    cluster_answers(["a", "b", "c"], equal=lambda a, b: calls.append((a, b)) or False)
    # one representative per cluster, first direction first
    assert calls == [("a", "b"), ("a", "c"), ("b", "c")]


# -- discrete semantic entropy ---------------------------------------------------------------------


def test_hand_case_two_clusters_of_three_and_one():
    batch = make_batch([HALVES])
    assert H_3_1 == pytest.approx(0.5623, abs=1e-4)
    out = SemanticEntropy()(batch, zeros(1, 4))
    assert out.shape == (1,) and out.dtype == torch.float32
    assert out.item() == pytest.approx(H_3_1, abs=1e-6)
    assert SemanticEntropy(normalize=True)(batch, zeros(1, 4)).item() == pytest.approx(H_3_1 / LN(4),
                                                                                       abs=1e-6)


def test_edge_groups_all_unanswered_all_equal_and_groups_stay_apart():
    unanswered = ("no idea", "hmm", "", "<answer> </answer>")  # a blank tag is no answer
    same = ("<answer>4</answer>", r"\boxed{4.0}", "it is 4", "<answer>x=4</answer>")
    batch = make_batch([unanswered, same, HALVES])
    out = SemanticEntropy()(batch, zeros(3, 4))
    assert out.tolist() == pytest.approx([LN(4), 0.0, H_3_1], abs=1e-6)  # 4 singletons: the maximum, ln G
    norm = SemanticEntropy(normalize=True)(batch, zeros(3, 4))
    assert norm.tolist() == pytest.approx([1.0, 0.0, H_3_1 / LN(4)], abs=1e-6)
    assert SemanticEntropy().cluster_ids(batch).tolist() == [[0, 1, 2, 3], [0, 0, 0, 0], [0, 0, 0, 1]]


def test_semantic_entropy_matches_a_naive_fp64_reference():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4, (6, 5), generator=gen)
    ll = torch.randn(6, 5, generator=gen, dtype=torch.float64) * 3
    members = torch.rand(6, 5, generator=gen) > 0.4
    members[0] = True
    members[1] = False  # an empty subset
    members[2] = torch.tensor([True, False, False, False, False])  # one member

    def naive(row_ids, row_ll, row_members, weighted):
        mass = {}
        for c, ll_s, m in zip(row_ids.tolist(), row_ll.tolist(), row_members.tolist()):
            if m:
                mass[c] = mass.get(c, 0.0) + (math.exp(ll_s) if weighted else 1.0)
        total = sum(mass.values())
        h = -sum(v / total * math.log(v / total) for v in mass.values())
        k = sum(row_members.tolist())
        return h, (h / math.log(k) if k >= 2 else 0.0)

    for weighted in (False, True):
        got = semantic_entropy(ids, log_likelihood=ll if weighted else None, members=members)
        got_norm = semantic_entropy(ids, log_likelihood=ll if weighted else None, members=members,
                                    normalize=True)
        want = [naive(ids[i], ll[i], members[i], weighted) for i in range(6)]
        assert got.tolist() == pytest.approx([w[0] for w in want], abs=1e-6)
        assert got_norm.tolist() == pytest.approx([w[1] for w in want], abs=1e-6)


# -- likelihood-weighted semantic entropy ----------------------------------------------------------


def test_likelihood_hand_case_probabilities_point_eight_and_point_two():
    # cluster {1/2, 0.5, \frac12} has mean log-likelihoods ln .4, ln .2, ln .2 (mass .8), {3} has ln .2:
    # p = .8 / .2 whatever the lengths; row 0 has two tokens averaging ln .4, and -inf padding
    inf = math.inf
    logprobs = torch.tensor([[LN(0.4) + 0.3, LN(0.4) - 0.3, -inf],
                             [LN(0.2), LN(0.2), LN(0.2)],
                             [LN(0.2), -inf, -inf],
                             [LN(0.2) + 1, LN(0.2) - 1, -inf]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    batch = make_batch([HALVES], logprobs, mask)
    assert sequence_log_likelihood(batch).tolist() == pytest.approx([LN(0.4), LN(0.2), LN(0.2), LN(0.2)],
                                                                    abs=1e-6)
    out = SemanticEntropy(mode="likelihood")(batch, zeros(1, 4))
    assert H_08_02 == pytest.approx(0.5004, abs=1e-4)
    assert out.item() == pytest.approx(H_08_02, abs=1e-6)
    assert SemanticEntropy(mode="likelihood", normalize=True)(batch, zeros(1, 4)).item() == pytest.approx(
        H_08_02 / LN(4), abs=1e-6)
    # sum-normalised over the sampled set: shifting every log-likelihood changes nothing
    shifted = make_batch([HALVES], logprobs - 50.0, mask)
    assert SemanticEntropy(mode="likelihood")(shifted, zeros(1, 4)).item() == pytest.approx(H_08_02, abs=1e-5)
    # counts ignore them
    assert SemanticEntropy()(batch, zeros(1, 4)).item() == pytest.approx(H_3_1, abs=1e-6)


def test_likelihood_with_tools_averages_over_the_models_tokens_only():
    # a tool's tokens (env_mask) carry log-prob 0 and are not the model's: row 0 is 2 model tokens of
    # ln .4 around 2 of a tool's, so l = ln .4 (counting the tool's tokens: ln .4 / 2); rows 1-3 are 1 model
    # token of ln .2 and 3 of a tool's, l = ln .2 (not ln .2 / 4): the hand case above again, p = .8 / .2
    logprobs = torch.tensor([[LN(0.4), 0.0, 0.0, LN(0.4)]] + [[LN(0.2), 0.0, 0.0, 0.0]] * 3)
    env = torch.tensor([[0, 1, 1, 0]] + [[0, 1, 1, 1]] * 3, dtype=torch.bool)
    batch = dataclasses.replace(make_batch([HALVES], logprobs), env_mask=env)
    assert sequence_log_likelihood(batch).tolist() == pytest.approx([LN(0.4), LN(0.2), LN(0.2), LN(0.2)],
                                                                    abs=1e-6)
    assert SemanticEntropy(mode="likelihood")(batch, zeros(1, 4)).item() == pytest.approx(H_08_02, abs=1e-6)


def test_likelihood_mode_without_sampler_logprobs_names_the_fix():
    assert SemanticEntropy(mode="likelihood").requires.sampler_logprobs
    assert not SemanticEntropy().requires.sampler_logprobs
    with pytest.raises(ValueError, match=r"HFSampler\(return_logprobs=True\)"):
        SemanticEntropy(mode="likelihood")(make_batch([HALVES]), zeros(1, 4))


# -- correctness-aware ---------------------------------------------------------------------------


def test_entropy_among_wrong_and_right_answers():
    # gold 3: one right (3), wrong ones 5, 5.0, 7 -> clusters of 2 and 1 among the 3 wrong
    texts = ("<answer>3</answer>", "<answer>5</answer>", "<answer>5.0</answer>", "<answer>7</answer>")
    batch = make_batch([texts])
    rewards = rewards_of([[1.0, 0.0, 0.0, 0.0]])
    assert SemanticEntropy(among="wrong")(batch, rewards).item() == pytest.approx(H_2_1, abs=1e-6)
    assert SemanticEntropy(among="wrong", normalize=True)(batch, rewards).item() == pytest.approx(
        H_2_1 / LN(3), abs=1e-6)
    assert SemanticEntropy(among="right", normalize=True)(batch, rewards).item() == 0.0  # 1 member: 0
    assert SemanticEntropy(among="all")(batch, rewards).item() == pytest.approx(
        -(0.5 * LN(0.5) + 2 * 0.25 * LN(0.25)), abs=1e-6)
    # the total mixes in a format bonus: on the total with threshold 1, the 5s count as right
    mixed = rewards_of([[1.1, 1.0, 1.0, 0.1]], acc=[[1.0, 0.0, 0.0, 0.0]])
    assert SemanticEntropy(among="wrong")(batch, mixed).item() == 0.0  # only the 7
    assert SemanticEntropy(among="right")(batch, mixed).item() == pytest.approx(H_2_1, abs=1e-6)  # 3, 5, 5.0
    by_acc = SemanticEntropy(among="wrong", correct_key="acc")
    assert by_acc(batch, mixed).item() == pytest.approx(H_2_1, abs=1e-6)
    assert SemanticEntropy(among="wrong", correct_threshold=1.05)(batch, mixed).item() == pytest.approx(H_2_1)
    # nobody wrong: an empty subset has entropy 0, normalised or not
    assert SemanticEntropy(among="wrong", normalize=True)(batch, rewards_of([[1.0] * 4])).item() == 0.0


def test_likelihood_among_wrong_renormalises_over_the_subset():
    # wrong: 5 and 5.0 with likelihoods .3 each, 7 with .15 -> p = .6/.75 = .8 and .2; the right 3 is ignored
    texts = ("<answer>3</answer>", "<answer>5</answer>", "<answer>5.0</answer>", "<answer>7</answer>")
    logprobs = torch.tensor([[LN(0.9)], [LN(0.3)], [LN(0.3)], [LN(0.15)]])
    batch = make_batch([texts], logprobs)
    out = SemanticEntropy(mode="likelihood", among="wrong")(batch, rewards_of([[1.0, 0.0, 0.0, 0.0]]))
    assert out.item() == pytest.approx(H_08_02, abs=1e-6)


def test_estimator_errors_name_the_value_and_fix():
    batch = make_batch([HALVES])
    with pytest.raises(ValueError, match="mode='entropy' must be"):
        SemanticEntropy(mode="entropy")
    with pytest.raises(ValueError, match="among='correct' must be"):
        SemanticEntropy(among="correct")
    with pytest.raises(ValueError, match="correct_threshold=None must be a number"):
        SemanticEntropy(correct_threshold=None)
    with pytest.raises(ValueError, match=r"correct_key='acc' is not a reward in the breakdown \['format'\]"):
        SemanticEntropy(among="wrong", correct_key="acc")(batch, rewards_of([[0.0] * 4], format=[[0.0] * 4]))
    with pytest.raises(ValueError, match=r"rewards.total shape \(4,\) must be \[B, G\]=\(1, 4\)"):
        SemanticEntropy()(batch, RewardOutput(torch.zeros(4)))


def test_estimator_is_pure_and_satisfies_the_protocol():
    se = SemanticEntropy(mode="likelihood", normalize=True)
    assert isinstance(se, EntropyEstimator)
    logprobs = torch.log(torch.tensor([[0.4], [0.2], [0.2], [0.2]]))
    batch, rewards = make_batch([HALVES], logprobs.clone()), zeros(1, 4)
    first, second = se(batch, rewards), se(batch, rewards)
    assert torch.equal(first, second) and not first.requires_grad
    assert torch.equal(batch.sampler_logprobs, logprobs) and torch.equal(rewards.total, torch.zeros(1, 4))


# -- EntropyScaled -------------------------------------------------------------------------------


@pytest.mark.parametrize(("fn", "factors"), [
    ("linear", [1.0, 0.5, 0.0]),  # 1 - u
    ("exponential", [1.0, math.exp(-0.5), math.exp(-1.0)]),  # e^-u
    ("inverse", [1.0, 1 / 1.5, 0.5]),  # 1 / (1 + u)
])
def test_entropy_scaled_hand_cases(fn, factors):
    rewards = torch.tensor([[1.0, 0.0]] * 3)  # mean-only base: +-0.5 in every group
    out = EntropyScaled(base=MeanBaseline(), fn=fn)(rewards, uncertainty=torch.tensor([0.0, 0.5, 1.0]))
    torch.testing.assert_close(out, torch.tensor([[0.5 * f, -0.5 * f] for f in factors]))


def test_entropy_scaled_strength_linear_clip_and_callable():
    rewards = torch.tensor([[1.0, 0.0]] * 3)
    u = torch.tensor([0.25, 0.5, 0.75])
    out = EntropyScaled(base=MeanBaseline(), strength=2.0)(rewards, uncertainty=u)
    assert out.tolist() == [[0.25, -0.25], [0.0, 0.0], [0.0, 0.0]]  # 1 - 1.5 is clipped to 0, not -0.5
    out = EntropyScaled(base=MeanBaseline(), strength=0.5, fn=lambda x: 1 - x**2)(rewards, uncertainty=u)
    assert out[:, 0].tolist() == pytest.approx([0.5 * (1 - 0.125**2), 0.5 * (1 - 0.25**2),
                                                0.5 * (1 - 0.375**2)])


@pytest.mark.parametrize("fn", ["linear", "exponential", "inverse"])
def test_zero_uncertainty_keeps_the_base_advantage_exactly(fn):
    rewards = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    base = GroupNormalized()(rewards)
    scaled = EntropyScaled(fn=fn, strength=3.0)(rewards, uncertainty=torch.tensor([0.0, 0.4, 0.0]))
    assert torch.equal(scaled[0], base[0]) and torch.equal(scaled[2], base[2])
    assert (scaled[1].abs() < base[1].abs()).all()
    off = EntropyScaled(fn=fn, strength=0.0)(rewards, uncertainty=torch.tensor([1.0, 0.4, 0.7]))
    assert torch.equal(off, base)


def test_entropy_scaled_errors_name_the_fix():
    adv = EntropyScaled()
    assert isinstance(adv, AdvantageFn)
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    with pytest.raises(ValueError, match=r"pass entropy=SemanticEntropy\(normalize=True\)"):
        adv(rewards)
    with pytest.raises(ValueError, match=r"uncertainty shape \(2, 1\) must be \[B\]=\(2,\)"):
        adv(rewards, uncertainty=torch.zeros(2, 1))
    with pytest.raises(ValueError, match=r"uncertainty shape \(3,\) must be"):
        adv(rewards, uncertainty=torch.zeros(3))
    with pytest.raises(ValueError, match=r"fn='focal' must be one of \['exponential', 'inverse', 'linear'\]"):
        EntropyScaled(fn="focal")
    with pytest.raises(ValueError, match="strength=-1.0 must be a finite number >= 0"):
        EntropyScaled(strength=-1.0)
    with pytest.raises(ValueError, match=r"fn returned shape \(\)"):
        EntropyScaled(fn=lambda x: x.sum())(rewards, uncertainty=torch.zeros(2))


def test_semantic_entropy_feeds_entropy_scaled():
    # group 0: 1/2-cluster right, 3 wrong; group 1: all unanswered (u = 1 -> linear factor 0)
    batch = make_batch([HALVES, ("?", "?", "?", "?")])
    rewards = rewards_of([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    u = SemanticEntropy(normalize=True)(batch, rewards)
    out = EntropyScaled(base=MeanBaseline())(rewards.total, uncertainty=u)
    factor = 1 - H_3_1 / LN(4)
    torch.testing.assert_close(out, torch.tensor([[0.25 * factor] * 3 + [-0.75 * factor], [0.0] * 4]))


def test_one_trainer_step_scales_the_advantages_by_the_semantic_entropy(tmp_path):
    from grpo_engine import GRPOConfig, GRPOTrainer, MemoryPlan
    from grpo_engine.data import PlainTemplate
    from grpo_engine.rewards import Reward
    from tests.tiny import char_tokenizer, tiny_llama

    class DigitShare(Reward):
        def score(self, prompt, completion):
            return sum(c.isdigit() for c in completion) / max(1, len(completion))

    seen = {}

    def estimator(batch, rewards):
        seen["u"] = SemanticEntropy(normalize=True)(batch, rewards)
        seen["rewards"] = rewards.total
        return seen["u"]

    estimator.requires = Requirements()  # the EntropyEstimator protocol's one attribute

    def advantage(rewards, *, uncertainty=None):
        seen["advantages"] = EntropyScaled()(rewards, uncertainty=uncertainty)
        return seen["advantages"]

    tokenizer = char_tokenizer()
    config = GRPOConfig(prompts_per_step=2, group_size=4, max_completion_tokens=6, max_steps=1, seed=0,
                        output_dir=str(tmp_path), progress_bar=False)
    trainer = GRPOTrainer(tiny_llama(len(tokenizer)), [DigitShare()],
                          [Prompt(f"{a}+1=", str(a + 1)) for a in range(4)],
                          tokenizer=tokenizer, template=PlainTemplate("{question}"), config=config,
                          memory=MemoryPlan(micro_batch_size=8), entropy=estimator, advantage=advantage)
    trainer.step()
    u = seen["u"]
    assert u.shape == (2,) and ((u >= 0) & (u <= 1)).all()
    want = GroupNormalized()(seen["rewards"]) * (1 - u).unsqueeze(1)
    torch.testing.assert_close(seen["advantages"], want)
