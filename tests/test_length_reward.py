"""OverlongPenalty (DAPO soft overlong punishment) and the batch-level reward path of WeightedSum."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
import torch

from grpo_engine.protocols import RewardFn
from grpo_engine.rewards import OverlongPenalty, Reward, RewardError, WeightedSum
from grpo_engine.types import Prompt, RolloutBatch

Q = Prompt("q")


def batch_with_lengths(lengths: list[int], group_size: int, width: int | None = None) -> RolloutBatch:
    """A batch whose completion i has ``lengths[i]`` kept tokens (right-padded to ``width``)."""
    n = len(lengths)
    width = width if width is not None else max(lengths)
    mask = torch.arange(width).expand(n, width) < torch.tensor(lengths).unsqueeze(1)
    return RolloutBatch(
        prompts=tuple(Prompt(f"q{i}") for i in range(n // group_size)),
        group_size=group_size,
        prompt_ids=torch.zeros(n, 1, dtype=torch.long),
        prompt_mask=torch.ones(n, 1, dtype=torch.bool),
        completion_ids=torch.zeros(n, width, dtype=torch.long),
        completion_mask=mask,
        is_truncated=torch.tensor([length >= width for length in lengths]),
        texts=tuple("x" * length for length in lengths),
    )


def dapo_reference(length: int, l_max: int, l_cache: int) -> Fraction:
    """DAPO's three cases, in exact rational arithmetic."""
    if length <= l_max - l_cache:
        return Fraction(0)
    if length <= l_max:
        return Fraction((l_max - l_cache) - length, l_cache)
    return Fraction(-1)


def test_boundaries_exact():
    """L_max = 20, L_c = 4, soft zone starts at 16: L = 16 -> 0; 17 -> (16-17)/4 = -0.25;
    18 -> -0.5; 20 = L_max -> (16-20)/4 = -1; 21 and beyond -> -1. All dyadic, so exact in float32."""
    penalty = OverlongPenalty(max_completion_tokens=20, cache_tokens=4)
    got = penalty.penalty(torch.tensor([0, 15, 16, 17, 18, 20, 21, 500]))
    assert got.dtype == torch.float32
    assert got.tolist() == [0.0, 0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]


def test_dapo_settings():
    """DAPO: 16,384 expected tokens + 4,096 cache = 20,480 limit. L = 16,385 -> -1/4096;
    L = 18,432 (half-way into the cache) -> -0.5; L = 20,480 -> -1."""
    penalty = OverlongPenalty(max_completion_tokens=20480, cache_tokens=4096)
    got = penalty.penalty(torch.tensor([16384, 16385, 18432, 20480]))
    assert got.tolist() == [0.0, -1 / 4096, -0.5, -1.0]


@pytest.mark.parametrize(("l_max", "l_cache"), [(10, 3), (7, 7), (7, 1), (100, 33)])
def test_matches_exact_reference_on_every_length(l_max, l_cache):
    penalty = OverlongPenalty(max_completion_tokens=l_max, cache_tokens=l_cache)
    lengths = list(range(0, l_max + 6))
    got = penalty.penalty(torch.tensor(lengths))
    want = torch.tensor([float(dapo_reference(n, l_max, l_cache)) for n in lengths], dtype=torch.float32)
    assert torch.equal(got, want)  # one float64 division, rounded once: the nearest float32
    assert got[l_max - l_cache].item() == 0.0 and got[l_max].item() == -1.0
    assert got[l_max - l_cache + 1].item() == pytest.approx(-1 / l_cache, rel=1e-7)


def test_score_rollout_uses_token_lengths_and_truncation_gives_minus_one():
    """L_max = 8, L_c = 4, completion_mask lengths [2, 4, 5, 8] in a batch padded to 8 tokens:
    [0, 0, (4-5)/4, -1]; the last one hit the limit (truncated) and gets exactly -1."""
    batch = batch_with_lengths([2, 4, 5, 8], group_size=2, width=8)
    assert batch.is_truncated.tolist() == [False, False, False, True]
    got = OverlongPenalty(max_completion_tokens=8, cache_tokens=4).score_rollout(batch)
    assert got.dtype == torch.float32 and got.tolist() == [0.0, 0.0, -0.25, -1.0]


def test_with_tools_the_penalty_and_the_length_metrics_count_the_models_tokens_only():
    """Two rollouts of 8 tokens, each with environment tokens (env_mask) inside: row 0 has 2 + 3 model
    tokens around 3 of a tool's (L = 5), row 1 1 model token then 7 of a tool's (L = 1). L_max = 8, L_c = 4:
    [(4-5)/4, 0] = [-0.25, 0], where counting every token would give [-1, -1]. The logged lengths: mean 3,
    max 5, 6 tokens generated (not 16)."""
    from grpo_engine.logging import rollout_metrics
    from grpo_engine.types import RewardOutput

    batch = batch_with_lengths([8, 8], group_size=2, width=8)
    env = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    batch = dataclasses.replace(batch, env_mask=env)
    assert batch.completion_lengths.tolist() == [5, 1]
    got = OverlongPenalty(max_completion_tokens=8, cache_tokens=4).score_rollout(batch)
    assert got.tolist() == [-0.25, 0.0]
    metrics = rollout_metrics(batch, RewardOutput(total=torch.zeros(1, 2), breakdown={}))
    lengths = [metrics[k] for k in ("completion_length/mean", "completion_length/max", "tokens/generated")]
    assert lengths == [3.0, 5.0, 6.0]


def test_weighted_sum_calls_score_rollout():
    """B = 2, G = 2, lengths [3, 8 | 6, 1], L_max = 8, L_c = 4: penalties [0, -1 | -0.5, 0];
    a text reward scoring len(text) / 10 gives [0.3, 0.8 | 0.6, 0.1]; with weight 2 on the penalty
    the totals are [0.3, -1.2 | -0.4, 0.1]. The breakdown keeps the raw, unweighted penalties."""

    class TextLength(Reward):
        def score(self, prompt: Prompt, completion: str) -> float:
            return len(completion) / 10

    combo = WeightedSum([TextLength(), OverlongPenalty(max_completion_tokens=8, cache_tokens=4, weight=2.0)])
    out = combo(batch_with_lengths([3, 8, 6, 1], group_size=2))
    torch.testing.assert_close(out.total, torch.tensor([[0.3, -1.2], [-0.4, 0.1]]))
    assert out.breakdown["overlong_penalty"].tolist() == [[0.0, -1.0], [-0.5, 0.0]]
    torch.testing.assert_close(out.breakdown["text_length"], torch.tensor([[0.3, 0.8], [0.6, 0.1]]))


def test_weighted_sum_checks_what_score_rollout_returns():
    class BadRollout:
        name, weight = "bad", 1.0

        def score_rollout(self, batch):
            return torch.zeros(batch.num_completions + 1)

    with pytest.raises(RewardError, match=r"'bad' returned shape \(5,\); expected \[N\]=\[4\]"):
        WeightedSum([BadRollout()])(batch_with_lengths([1, 2, 3, 4], group_size=2))


def test_text_call_is_a_clear_error():
    penalty = OverlongPenalty(max_completion_tokens=8, cache_tokens=4)
    pattern = (r"'overlong_penalty' \(OverlongPenalty\) scores completion lengths in tokens"
               r".*inside WeightedSum")
    with pytest.raises(TypeError, match=pattern):
        penalty([Q], ["text"])
    with pytest.raises(TypeError, match=pattern):
        penalty.score(Q, "text")


def test_defaults_protocol_and_repr():
    penalty = OverlongPenalty(max_completion_tokens=1024, cache_tokens=256)
    assert (penalty.name, penalty.weight) == ("overlong_penalty", 1.0)
    assert isinstance(penalty, RewardFn)
    assert repr(penalty) == (
        "OverlongPenalty(max_completion_tokens=1024, cache_tokens=256, weight=1.0, name='overlong_penalty')"
    )
    assert OverlongPenalty(8, 8, weight=0.5, name="len").name == "len"


@pytest.mark.parametrize(
    ("l_max", "l_cache", "weight", "pattern"),
    [
        (8, 0, 1.0, r"cache_tokens=0 must be a positive integer"
                    r".*0 < cache_tokens <= max_completion_tokens=8"),
        (8, 9, 1.0, r"cache_tokens=9 must be <= max_completion_tokens=8.*e.g. 2"),
        (8, 2.5, 1.0, r"cache_tokens=2.5 must be a positive integer"),
        (8, True, 1.0, r"cache_tokens=True must be a positive integer"),
        (0, 1, 1.0, r"max_completion_tokens=0 must be a positive integer.*e.g. 1024"),
        (8, 4, float("inf"), r"weight=inf must be a finite real"),
    ],
)
def test_validation_names_value_rule_and_fix(l_max, l_cache, weight, pattern):
    with pytest.raises(ValueError, match=pattern):
        OverlongPenalty(max_completion_tokens=l_max, cache_tokens=l_cache, weight=weight)
