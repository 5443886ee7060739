"""The demo's parts that run without its model: the threads it takes, its tasks and its rewards."""

from __future__ import annotations

import pytest
import torch

import grpo_engine.demo as demo
from grpo_engine.types import Prompt, RolloutBatch


class FakeStat:
    """``/proc/stat`` read twice: cpu0 90% busy between the reads (another process), cpu1 10%."""

    reads = iter(["cpu  0 0 0 0 0\ncpu0 100 0 0 900 0\ncpu1 100 0 0 900 0\nintr 1 2\n",
                  "cpu  0 0 0 0 0\ncpu0 170 0 20 910 0\ncpu1 110 0 0 990 0\nintr 1 2\n"])

    def __init__(self, path):
        assert str(path) == "/proc/stat"

    def read_text(self):
        return next(self.reads)


def test_idle_cores_leaves_out_the_cpus_busy_with_other_work(monkeypatch):
    monkeypatch.setattr(demo, "Path", FakeStat)
    monkeypatch.setattr(demo.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(demo.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert demo.idle_cores() == 1  # cpu0: (70 + 20) / 100 busy; cpu1: 10 / 100

    def unreadable(path):
        raise OSError("no /proc here")

    monkeypatch.setattr(demo, "Path", unreadable)
    assert demo.idle_cores() == 2  # every CPU of the affinity


def test_the_recipe_rewards_a_completion_that_ends_over_one_that_runs_on():
    """Both say 97; only the one that ended (at 10 tokens) counts, the one cut at the limit scores 0."""
    from grpo_engine.rewards import WeightedSum

    rewards = WeightedSum(demo.recipe_rewards(demo.DemoSettings()))
    n = 2
    mask = torch.zeros(n, 16, dtype=torch.bool)
    mask[0, :10], mask[1, :] = True, True
    ids = torch.zeros(n, 16, dtype=torch.long)
    texts = ("63 + 34 = 97.", "63 + 34 = 97. Now, to find the final")
    prompt_mask = torch.ones(n, 2, dtype=torch.bool)
    batch = RolloutBatch((Prompt("What is 63 + 34?", "97"),), n, ids[:, :2], prompt_mask, ids, mask,
                         torch.tensor([False, True]), texts)
    out = rewards(batch)
    assert out.breakdown["math_accuracy"].tolist() == out.total.tolist() == [[1.0, 0.0]]
    plain = WeightedSum(demo.recipe_rewards(demo.DemoSettings(finished_only=False)))
    assert plain(batch).total.tolist() == [[1.0, 1.0]]


def test_the_demo_tasks_and_a_bad_task_name():
    train, test = demo.demo_task(demo.DemoSettings(num_train=5, num_test=3))
    assert len(train) == 5 and len(test) == 3 and train[0].question.startswith("What is")
    train, _ = demo.demo_task(demo.DemoSettings(task="comparison", num_train=5, num_test=3))
    assert all(p.question.startswith("Which is the") for p in train)
    with pytest.raises(ValueError, match="task='poetry' is not one of"):
        demo.demo_task(demo.DemoSettings(task="poetry"))
