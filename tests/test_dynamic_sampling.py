"""DAPO dynamic sampling: which groups are kept, how many rounds run, and exact batch surgery."""

import pytest
import torch

from grpo_engine.distributed import DataParallel, World
from grpo_engine.logging import StageTimer
from grpo_engine.rollout import Rollouts
from grpo_engine.sampling.dynamic import DynamicSampling
from grpo_engine.types import Prompt, RewardOutput, Rollout, RolloutBatch

G = 2


def fake_batch(rewards_rows, start, prompt_width=3, completion_width=4):
    """B groups of G completions; prompt b is 'p<start+b>' and its completion ids encode (b, g)."""
    b = len(rewards_rows)
    n = b * G
    prompt_ids = torch.arange(n * prompt_width).reshape(n, prompt_width)
    completion_ids = torch.arange(n * completion_width).reshape(n, completion_width) + 1000 * start
    batch = RolloutBatch(
        prompts=tuple(Prompt(f"p{start + i}", "1") for i in range(b)), group_size=G,
        prompt_ids=prompt_ids, prompt_mask=torch.ones(n, prompt_width, dtype=torch.bool),
        completion_ids=completion_ids, completion_mask=torch.ones(n, completion_width, dtype=torch.bool),
        is_truncated=torch.zeros(n, dtype=torch.bool), texts=tuple(f"t{start}-{i}" for i in range(n)),
        sampler_logprobs=-torch.rand(n, completion_width),
    )
    total = torch.tensor(rewards_rows, dtype=torch.float32)
    return batch, RewardOutput(total=total, breakdown={"acc": total.clone()})


class Script:
    """A sampler of scripted rounds (one reward row per group), its reward function, and a prompt
    source; records how many prompts each round got and how many the source was asked for."""

    temperature = 1.0

    def __init__(self, rounds, breakdown=None):
        self.rounds, self.asked, self.refills, self.start, self.scores = list(rounds), [], [], 0, {}
        self.breakdown = breakdown

    def prompt_tokens(self, prompt):
        return [0]

    def sample(self, prompts, *, group_size, temperature, draws):
        self.asked.append(len(prompts))
        rows = self.rounds.pop(0)[:len(prompts)]
        batch, rewards = fake_batch(rows, self.start)
        if self.breakdown is not None:
            rewards = RewardOutput(rewards.total, {"acc": torch.tensor(self.breakdown, dtype=torch.float32)})
        self.scores[batch.texts] = rewards
        self.start += len(rows)
        return batch

    def score(self, batch):
        return self.scores[batch.texts]

    def next_batch(self, size=None):
        self.refills.append(size)
        return [Prompt("fresh")] * size


def trained(batch):
    return [p.question for p, keep in zip(batch.prompts, batch.trained_groups.tolist()) if keep]


def draw(script, num_prompts, **kw):
    """The whole step's rollout (every group drawn) the trainer collects with ``DynamicSampling(**kw)``."""
    rollouts = Rollouts(script, script.score, None, DataParallel(World()), group_size=G,
                        group_filter=DynamicSampling(**kw), refill=script)
    return rollouts.collect([Prompt("q")] * num_prompts, temperature=1.0, timer=StageTimer()).whole


def test_keeps_informative_groups_and_tops_up_with_fresh_prompts():
    # round 1: groups 0 and 2 tie, 1 and 3 carry signal (2 kept of 4); round 2 asks for the 2 missing
    script = Script([[[1, 1], [1, 0], [0, 0], [0, 1]], [[1, 0], [1, 1]], [[0, 1], [0, 1]]])
    rollout = draw(script, 4, max_rounds=3)
    batch = rollout.batch
    assert script.asked == [4, 2, 1] and script.refills == [2, 1]
    assert trained(batch) == ["p1", "p3", "p4", "p6"]
    assert batch.num_prompts == 7  # every group drawn stays in the batch, for the callbacks and the source
    assert rollout.rewards.total[batch.trained_groups].tolist() == [[1, 0], [0, 1], [1, 0], [0, 1]]
    assert dict(batch.metrics) == {"dynamic_sampling/rounds": 3.0, "dynamic_sampling/groups_sampled": 7.0,
                                   "dynamic_sampling/groups_kept": 4.0,
                                   "reward/mean_sampled": pytest.approx(8 / 14)}  # (4 + 3 + 1) / (8 + 4 + 2)
    # rows follow their prompts: p3 was group 3 of round 1 -> rows 6, 7 of that batch
    picked = rollout.trained().batch
    first, _ = fake_batch([[1, 1], [1, 0], [0, 0], [0, 1]], 0)
    assert torch.equal(picked.completion_ids[2:4], first.completion_ids[6:8])
    assert picked.texts[2:4] == ("t0-6", "t0-7")


def test_bounded_rounds_and_nothing_informative():
    script = Script([[[1, 1], [0, 0]]] * 2)
    batch = draw(script, 2, max_rounds=2).batch
    assert (batch.metrics["dynamic_sampling/groups_kept"] == 0
            and batch.metrics["dynamic_sampling/rounds"] == 2)
    assert trained(batch) == ["p2", "p3"]  # the last round, as is (every advantage 0)
    with pytest.raises(ValueError, match="max_rounds=0 must be >= 1"):
        DynamicSampling(max_rounds=0)


def test_concat_repads_prompts_left_and_completions_right():
    a, _ = fake_batch([[1, 0]], 0, prompt_width=2, completion_width=5)
    b, _ = fake_batch([[0, 1]], 1, prompt_width=4, completion_width=3)
    both = RolloutBatch.concat([a, b])
    assert both.prompt_ids.shape == (4, 4) and both.completion_ids.shape == (4, 5)
    assert both.prompt_mask[:2].tolist() == [[False, False, True, True]] * 2
    assert torch.equal(both.prompt_ids[:2, 2:], a.prompt_ids)
    assert both.completion_mask[2:].tolist() == [[True, True, True, False, False]] * 2
    assert torch.equal(both.sampler_logprobs[2:, :3], b.sampler_logprobs)
    picked = Rollout(both, RewardOutput(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))).select_groups(
        torch.tensor([1]))
    assert torch.equal(picked.batch.completion_ids, both.completion_ids[2:])
    assert picked.rewards.total.tolist() == [[0, 1]]


def test_filter_on_one_reward_of_the_breakdown():
    """Totals differ in both groups, but accuracy ties in the first: only the second is kept."""
    script = Script([[[0.9, 1.0], [1.0, 0.0]]], breakdown=[[1.0, 1.0], [1.0, 0.0]])
    batch = draw(script, 2, max_rounds=1, key="acc").batch
    assert trained(batch) == ["p1"] and batch.metrics["dynamic_sampling/groups_kept"] == 1
    with pytest.raises(KeyError, match="key='nope'"):
        draw(Script([[[0.9, 1.0], [1.0, 0.0]]]), 2, max_rounds=1, key="nope")
    # a reward that returned None (NaN) for a sample: the group's spread is undefined, and NaN != x would
    # have called it informative
    nan = float("nan")
    with pytest.raises(ValueError, match=r"DynamicSampling\(key='acc'\): the reward 'acc' returned None "
                                         r"for 1 of 4 samples .* name a reward that scores every sample"):
        draw(Script([[[0.9, 1.0], [1.0, 0.0]]], breakdown=[[1.0, nan], [1.0, 0.0]]), 2, max_rounds=1,
             key="acc")
