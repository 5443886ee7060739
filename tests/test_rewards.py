"""Rewards: the subclass contract, math-verify accuracy, format rewards, the weighted sum."""

from __future__ import annotations

import math
import re
import threading

import pytest
import torch

from grpo_engine.ops import answers as math_module
from grpo_engine.protocols import RewardFn
from grpo_engine.rewards import (
    BoxedFormat,
    MathAccuracy,
    Reward,
    RewardError,
    ThinkAnswerFormat,
    WeightedSum,
    answers_equal,
    extract_answer,
)
from grpo_engine.rewards.format import boxed_contents
from grpo_engine.types import Prompt, RolloutBatch

Q = Prompt("What is 7 + 5?", target="12")


class KeywordBonus(Reward):
    """A user reward written the documented way: only ``score``, no ``__init__``."""

    def score(self, prompt: Prompt, completion: str) -> float:
        return 0.5 * completion.count("because")


def make_batch(prompts: list[Prompt], texts: list[str], group_size: int) -> RolloutBatch:
    n = len(texts)
    ones = torch.ones(n, 1, dtype=torch.bool)
    return RolloutBatch(
        prompts=tuple(prompts),
        group_size=group_size,
        prompt_ids=torch.zeros(n, 1, dtype=torch.long),
        prompt_mask=ones,
        completion_ids=torch.zeros(n, 1, dtype=torch.long),
        completion_mask=ones,
        is_truncated=torch.zeros(n, dtype=torch.bool),
        texts=tuple(texts),
    )


# --- the Reward base -------------------------------------------------------------------


def test_subclass_with_only_score_is_a_reward_fn():
    r = KeywordBonus()
    assert isinstance(r, RewardFn)
    assert (r.name, r.weight) == ("keyword_bonus", 1.0)
    out = r([Q, Q, Q], ["no", "because", "because because"])
    assert out.dtype == torch.float32 and out.shape == (3,)
    assert out.tolist() == [0.0, 0.5, 1.0]
    assert r([], []).shape == (0,)


def test_name_defaults_and_overrides():
    class HTTPLengthReward(KeywordBonus):
        pass

    class Named(KeywordBonus):
        name = "custom"

    assert MathAccuracy().name == "math_accuracy"
    assert ThinkAnswerFormat().name == "think_answer_format"
    assert HTTPLengthReward().name == "http_length_reward"
    assert Named().name == "custom"
    r = KeywordBonus(weight=2, name="kw")
    assert (r.name, r.weight) == ("kw", 2.0) and isinstance(r.weight, float)


def test_subclass_init_without_super_still_has_name_and_weight():
    class Forgetful(KeywordBonus):
        def __init__(self, word: str) -> None:
            self.word = word

    r = Forgetful("x")
    assert (r.name, r.weight) == ("forgetful", 1.0)
    assert r([Q], ["because"]).tolist() == [0.5]


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), "1.0", None, True])
def test_bad_weight_is_rejected_with_value_and_fix(weight):
    with pytest.raises(ValueError, match=r"KeywordBonus: weight=.* must be a finite real number"):
        KeywordBonus(weight=weight)


def test_bad_name_and_length_mismatch():
    with pytest.raises(ValueError, match="name='' must be a non-empty string"):
        KeywordBonus(name="")
    with pytest.raises(ValueError, match="got 2 prompts and 1 completions; pass one prompt per"):
        KeywordBonus()([Q, Q], ["a"])


def test_raising_score_names_reward_sample_and_excerpts():
    class Fragile(Reward):
        def score(self, prompt: Prompt, completion: str) -> float:
            if completion == "bad":
                raise KeyError("missing")
            return 1.0

    long_q = Prompt("Q" * 500)
    with pytest.raises(RewardError) as info:
        Fragile()([long_q, long_q, long_q], ["ok", "ok", "bad"])
    msg = str(info.value)
    assert "reward 'fragile'" in msg and "sample 2" in msg and "KeyError" in msg
    assert "completion='bad'" in msg and "QQQ..." in msg and "Q" * 100 not in msg
    assert isinstance(info.value.__cause__, KeyError)
    assert isinstance(info.value, RuntimeError)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), None, "1.0"])
def test_non_finite_or_non_numeric_score_is_an_error(value):
    class Broken(Reward):
        def score(self, prompt: Prompt, completion: str) -> float:
            return value if completion == "x" else 0.0

    pattern = rf"'broken' returned {re.escape(repr(value))} .* on sample 1"
    with pytest.raises(RewardError, match=pattern):
        Broken()([Q, Q], ["ok", "x"])


def test_score_batch_override_is_used_and_validated():
    class Vectorised(Reward):
        calls = 0

        def score_batch(self, prompts, completions):
            Vectorised.calls += 1
            return [len(c) for c in completions][: self.keep]

    r = Vectorised()
    r.keep = 3
    assert r([Q] * 3, ["a", "bb", "ccc"]).tolist() == [1.0, 2.0, 3.0]
    assert Vectorised.calls == 1
    r.keep = 2
    with pytest.raises(RewardError, match="returned 2 scores for 3 completions"):
        r([Q] * 3, ["a", "bb", "ccc"])


def test_base_without_score_says_what_to_implement():
    with pytest.raises(RewardError, match=r"must implement score\(self, prompt, completion\)"):
        Reward()([Q], ["x"])


# --- MathAccuracy ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "completion", "expected"),
    [
        ("0.5", r"so \boxed{\frac{1}{2}}", 1.0),  # fraction == decimal
        (r"\frac{1}{2}", "<answer>0.5</answer>", 1.0),
        ("1000", r"\boxed{1,000}", 1.0),  # thousands separator
        ("1,000", "<answer>1000</answer>", 1.0),
        ("-7", "The answer is -7.", 1.0),  # no tag or box: the last number
        ("97", "To add 63 + 34, we need to", 0.0),  # a restated question is not an answer
        ("97", "63 + 34 = 97, done", 1.0),
        ("120", "12 + 95 = 120.", 1.0),
        ("1000", "it costs 1,000 dollars", 1.0),
        ("0.75", "x = 3/4", 1.0),
        ("0.5", r"it is \frac{1}{2} of it", 1.0),
        ("-7", "<answer>7</answer>", 0.0),  # sign matters
        ("12", "<think>maybe 11</think>\n<answer>12</answer>", 1.0),
        ("12", r"first \boxed{11}, no: \boxed{12}", 1.0),  # last box
        ("12", r"<answer>11</answer> or \boxed{12}", 0.0),  # the tag wins over a box
        ("12", r"<answer>\boxed{12}</answer>", 1.0),
        ("x^2+1", "<answer>x^2+1</answer>", 1.0),  # wrapped, not read as prose
        ("12", "<answer>13</answer>", 0.0),  # wrong
        ("12", "I have no idea.", 0.0),  # no answer at all
        ("12", "", 0.0),
        ("12", "<answer> </answer> 12", 0.0),  # a blank tag is no answer
    ],
)
def test_math_accuracy(target, completion, expected):
    p = Prompt("q", target=target)
    assert MathAccuracy()([p], [completion]).tolist() == [expected]


def test_math_accuracy_needs_a_target():
    with pytest.raises(RewardError, match=r"sample 1.*MathAccuracy needs Prompt.target"):
        MathAccuracy()([Q, Prompt("no target")], ["12", "12"])


def test_unparseable_target_is_an_error():
    with pytest.raises(RewardError, match="math-verify cannot parse Prompt.target=''"):
        MathAccuracy()([Prompt("q", target="")], ["12"])


@pytest.mark.parametrize(("target", "problem"), [
    ("12", None), ("1,000", None), ("\\frac{1}{2}", None), ("\\text{east}", None), ("sin(x)", None),
    ("x^2+1", None), ("hello world", "target 'hello world' is words, not a math answer"),
    ("", "math-verify cannot parse target ''"), (None, "no target (the reference answer)"),
])
def test_math_accuracy_checks_targets_before_training(target, problem):
    found = MathAccuracy().check(Prompt("q", target=target))
    assert found == problem if problem is None else found.startswith(problem)


def test_extract_answer():
    assert extract_answer("<answer>1</answer> <answer> 2 </answer>") == "2"
    assert extract_answer(r"\boxed{\frac{1}{2}} then \boxed{3}") == "3"
    assert extract_answer(r"<answer>4</answer> \boxed{5}") == "4"
    assert extract_answer(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert extract_answer("just 12") is None
    assert extract_answer("<answer>  </answer>") is None
    assert extract_answer(r"\boxed{12") is None


def test_answers_equal():
    assert answers_equal(r"\frac{1}{2}", "0.5")
    assert answers_equal("1,000", "1000")
    assert answers_equal("-7", "-7.0")
    assert not answers_equal("2", "3")
    assert not answers_equal("", "")  # nothing parses, nothing is equal


def test_timeouts_only_in_the_main_thread(monkeypatch):
    seen: list[object] = []
    real_parse = math_module.parse

    def spy(text, parsing_timeout):
        seen.append(parsing_timeout)
        return real_parse(text, parsing_timeout=parsing_timeout)

    monkeypatch.setattr(math_module, "parse", spy)
    math_module._parse_cached.cache_clear()
    p = Prompt("q", target="0.5")
    assert MathAccuracy(isolate=False)([p], [r"\boxed{\frac{1}{2}}"]).tolist() == [1.0]  # in this process
    assert seen and set(seen) == {math_module.TIMEOUT_SECONDS}

    seen.clear()
    results: list[object] = []
    thread = threading.Thread(
        target=lambda: results.append(MathAccuracy(isolate=False)([p], [r"\boxed{\frac{1}{2}}"]))
    )
    thread.start()
    thread.join()
    # With a timeout, math-verify would raise "signal only works in main thread".
    assert results and results[0].tolist() == [1.0]
    assert seen and set(seen) == {None}


# --- format rewards ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>7+5</think><answer>12</answer>", 1.0),
        ("\n  <think>\nline\nline\n</think>\n\n<answer>12</answer>\n", 1.0),
        ("<think></think><answer></answer>", 1.0),
        ("<answer>12</answer><think>x</think>", 0.0),  # wrong order
        ("<answer>12</answer>", 0.0),  # no think
        ("<think>x</think>", 0.0),  # no answer
        ("<think>x</think><answer>12</answer> trailing", 0.0),
        ("lead <think>x</think><answer>12</answer>", 0.0),
        ("<think>x</think><answer>1</answer><answer>2</answer>", 0.0),  # two answers
        ("<think><think>x</think><answer>1</answer>", 0.0),
        ("<think>x</think><answer>12", 0.0),  # truncated
    ],
)
def test_think_answer_format(completion, expected):
    assert ThinkAnswerFormat()([Q], [completion]).tolist() == [expected]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (r"\boxed{12}", 1.0),
        (r"so x = \boxed{\frac{1}{2}}.", 1.0),
        (r"\boxed{}", 0.0),
        (r"\boxed{  }", 0.0),
        (r"\boxed{12", 0.0),
        (r"\boxed{\frac{1}{2}", 0.0),
        ("boxed 12", 0.0),
    ],
)
def test_boxed_format(completion, expected):
    assert BoxedFormat()([Q], [completion]).tolist() == [expected]


def test_boxed_contents_follows_nested_braces():
    assert boxed_contents(r"\boxed{a{b}c} x \boxed{d") == ["a{b}c"]


# --- WeightedSum -------------------------------------------------------------------------


def test_weighted_sum_totals_and_breakdown():
    """B=2, G=2. Accuracy (w=1): [1, 1 | 0, 1]; format (w=0.5): [1, 0 | 1, 1];
    keyword (w=-2): [0, 0 | 0, 0.5]. Total: [[1.5, 1.0], [0.5, 0.5]]."""
    prompts = [Prompt("2+2?", target="4"), Prompt("3*3?", target="9")]
    texts = [
        "<think>.</think><answer>4</answer>",
        "it is 4",
        "<think>.</think><answer>8</answer>",
        "<think>because</think><answer>9</answer>",
    ]
    combo = WeightedSum([MathAccuracy(), ThinkAnswerFormat(weight=0.5), KeywordBonus(weight=-2)])
    out = combo(make_batch(prompts, texts, group_size=2))
    assert combo.names == ("math_accuracy", "think_answer_format", "keyword_bonus")
    assert out.total.dtype == torch.float32
    torch.testing.assert_close(out.total, torch.tensor([[1.5, 1.0], [0.5, 0.5]]))
    assert list(out.breakdown) == list(combo.names)
    torch.testing.assert_close(
        out.breakdown["math_accuracy"], torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    )
    torch.testing.assert_close(
        out.breakdown["think_answer_format"], torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    )
    torch.testing.assert_close(
        out.breakdown["keyword_bonus"], torch.tensor([[0.0, 0.0], [0.0, 0.5]])
    )


def test_weighted_sum_construction_errors():
    with pytest.raises(ValueError, match="at least one reward"):
        WeightedSum([])
    with pytest.raises(
        ValueError, match=r"two rewards are named 'math_accuracy'.*name='math_accuracy_2'"
    ):
        WeightedSum([MathAccuracy(), MathAccuracy(weight=2.0)])
    with pytest.raises(TypeError, match="is not a RewardFn"):
        WeightedSum([object()])
    with pytest.raises(ValueError, match="name='<lambda>' cannot key the logs; pass name="):
        WeightedSum([lambda prompts, completions: [0.0] * len(prompts)])  # a plain function needs a name


class Raw:
    """A protocol-only reward (no base class) that returns whatever it is told to."""

    def __init__(self, result, weight: float = 1.0) -> None:
        self.name, self.weight, self.result = "raw", weight, result

    def __call__(self, prompts, completions):
        return self.result


@pytest.mark.parametrize(
    ("result", "weight", "error", "pattern"),
    [
        (torch.zeros(5), 1.0, RewardError, r"'raw' returned shape \(5,\); expected \[N\]=\[4\]"),
        (torch.zeros(2, 2), 1.0, RewardError, r"'raw' returned shape \(2, 2\)"),
        (torch.ones(4, dtype=torch.long), 1.0, RewardError, r"'raw' returned dtype torch.int64"),
        ([0.0] * 4, 1.0, RewardError, r"'raw' returned list"),
        (
            torch.tensor([0.0, math.nan, 0.0, 0.0]),
            1.0,
            RewardError,
            r"non-finite scores at samples \[1\]",
        ),
        (torch.zeros(4), math.nan, ValueError, r"reward 'raw': weight=nan must be a finite real number"),
    ],
)
def test_weighted_sum_checks_what_rewards_return(result, weight, error, pattern):
    batch = make_batch([Q, Q], ["a", "b", "c", "d"], group_size=2)
    with pytest.raises(error, match=pattern):
        WeightedSum([Raw(result, weight)])(batch)


def test_weighted_sum_propagates_reward_errors():
    batch = make_batch([Q, Prompt("no target")], ["12", "12", "12", "12"], group_size=2)
    with pytest.raises(RewardError, match="'math_accuracy'.*sample 2"):
        WeightedSum([MathAccuracy()])(batch)


class Fixed:
    """A protocol-only reward returning fixed scores [N] (row b * G + g)."""

    def __init__(self, name: str, scores: list[float], weight: float = 1.0) -> None:
        self.name, self.weight, self.scores = name, weight, scores

    def __call__(self, prompts, completions):
        return torch.tensor(self.scores)


def two_rewards(weight_large: float = 0.5) -> list[Fixed]:
    return [
        Fixed("small", [0.0, 1.0, 2.0, 1.0, 1.0, 1.0]),
        Fixed("large", [40.0, 0.0, 20.0, 0.0, 100.0, 50.0], weight=weight_large),
    ]


def test_weighted_sum_normalize_each_hand_values():
    """B=2, G=3. small (w=1): [0, 1, 2 | 1, 1, 1]; large (w=0.5): [40, 0, 20 | 0, 100, 50].
    Group z-scores (unbiased std): small [0,1,2] mean 1, std 1 -> [-1, 0, 1]; [1,1,1] -> [0, 0, 0].
    large [40,0,20] mean 20, deviations [20,-20,0], variance 800/2, std 20 -> [1, -1, 0];
    [0,100,50] mean 50, std 50 -> [-1, 1, 0].
    each:      [-1 + 0.5, 0 - 0.5, 1 + 0 | 0 - 0.5, 0 + 0.5, 0] = [-0.5, -0.5, 1 | -0.5, 0.5, 0]
    after_sum: [0 + 20, 1 + 0, 2 + 10 | 1 + 0, 1 + 50, 1 + 25] = [20, 1, 12 | 1, 51, 26]
    (the large reward alone orders the completions; z-scored, both count)."""
    batch = make_batch([Q, Q], list("abcdef"), group_size=3)
    each = WeightedSum(two_rewards(), normalize="each")(batch)
    torch.testing.assert_close(each.total, torch.tensor([[-0.5, -0.5, 1.0], [-0.5, 0.5, 0.0]]), rtol=0,
                               atol=1e-5)
    after = WeightedSum(two_rewards())(batch)
    torch.testing.assert_close(after.total, torch.tensor([[20.0, 1.0, 12.0], [1.0, 51.0, 26.0]]))
    for out in (each, after):  # the breakdown is always the raw, unweighted scores
        assert out.breakdown["small"].tolist() == [[0.0, 1.0, 2.0], [1.0, 1.0, 1.0]]
        assert out.breakdown["large"].tolist() == [[40.0, 0.0, 20.0], [0.0, 100.0, 50.0]]


def test_weighted_sum_normalize_each_matches_reference_and_equal_groups_give_exact_zero():
    """Each reward [B, G] goes through GroupNormalized() (group std, eps 1e-6, exact 0 where a
    reward is constant in a group); a reward constant in every group adds exactly nothing."""
    from grpo_engine.advantages import GroupNormalized

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(12, generator=gen), torch.rand(12, generator=gen) * 100
    rewards = [Fixed("a", a.tolist(), weight=1.5), Fixed("b", b.tolist(), weight=-0.25),
               Fixed("c", [0.1] * 12)]
    out = WeightedSum(rewards, normalize="each")(make_batch([Q] * 3, ["x"] * 12, group_size=4))
    want = 1.5 * GroupNormalized()(a.view(3, 4)) - 0.25 * GroupNormalized()(b.view(3, 4))
    assert torch.equal(out.total, want)


def test_weighted_sum_normalize_each_then_batch_whitening_is_gdpo():
    """normalize='each' + ReinforcePlusPlusBaseline == TRL's 'normalize_then_sum' (GDPO):
    per-reward group z-score, weighted sum, then (t - mean) / std over the batch (eps aside)."""
    from grpo_engine.advantages import ReinforcePlusPlusBaseline

    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(2, 4, 3, generator=gen, dtype=torch.float64)  # [K rewards, B, G]
    weights = torch.tensor([1.0, 0.3], dtype=torch.float64)
    z = (scores - scores.mean(-1, keepdim=True)) / scores.std(-1, keepdim=True)
    t = (weights[:, None, None] * z).sum(0)
    want = (t - t.mean()) / t.std()
    rewards = [Fixed(f"r{k}", scores[k].flatten().tolist(), weight=weights[k].item()) for k in range(2)]
    total = WeightedSum(rewards, normalize="each")(make_batch([Q] * 4, ["x"] * 12, group_size=3)).total
    torch.testing.assert_close(ReinforcePlusPlusBaseline(eps=0.0)(total).double(), want, rtol=1e-4, atol=1e-4)


def test_weighted_sum_prefers_score_rollout():
    class Both:
        name, weight = "both", 1.0

        def __call__(self, prompts, completions):
            raise AssertionError("__call__ must not be used when score_rollout exists")

        def score_rollout(self, batch):
            return torch.arange(batch.num_completions, dtype=torch.float32)

    out = WeightedSum([Both()])(make_batch([Q, Q], list("abcd"), group_size=2))
    assert out.total.tolist() == [[0.0, 1.0], [2.0, 3.0]]


def test_weighted_sum_normalize_errors_and_repr():
    with pytest.raises(ValueError, match=r"normalize='before_sum' must be 'after_sum' .* or 'each'"):
        WeightedSum([MathAccuracy()], normalize="before_sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"normalize='each'\): group_size=1 makes every .* "
                                         r"use group_size >= 2"):
        WeightedSum([Fixed("a", [1.0, 0.0])], normalize="each")(make_batch([Q, Q], ["a", "b"], group_size=1))
    assert repr(WeightedSum([MathAccuracy()], normalize="each")).endswith(", normalize='each')")
    assert "normalize" not in repr(WeightedSum([MathAccuracy()]))
