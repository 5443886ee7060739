"""reasoning-gym as prompts, reward and difficulty knob (grpo_engine.tasks): the scores are the package's
own, the splits never share a question, composites keep their weights, the level rises at the step the
rule says, and run files, the CLI and a missing install all say what they should.

reasoning-gym is imported unconditionally: ``make test`` installs the ``[tasks]`` extra, so a missing
package fails here instead of skipping.
"""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
import reasoning_gym
import torch
from reasoning_gym.utils import extract_answer

from grpo_engine.data.errors import DataError
from grpo_engine.tasks import DifficultyCurriculum, ReasoningGymScore, reasoning_gym_task
from grpo_engine.types import Prompt, RewardOutput

NARROW = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # chain_sum: 200 questions


def questions(prompts):
    return [p.question for p in prompts]


# -- the reward -------------------------------------------------------------------------------------


def package_score(prompt, completion):
    """What reasoning-gym itself gives: its extractor, then the family's scorer on the entry."""
    source = prompt.metadata["reasoning_gym"]
    dataset = reasoning_gym.create_dataset(source["family"], **source["config"])
    return dataset.score_answer(extract_answer(completion), prompt.metadata["entry"])


def test_the_reward_is_the_familys_own_score_with_its_partial_credit():
    (word,), _ = reasoning_gym_task("spell_backward", 1, 0, seed=0)
    (sum_,), _ = reasoning_gym_task("chain_sum", 1, 0, seed=0)
    right_word, right_sum = word.target, sum_.target
    assert len(right_word) == 9  # seed 0's word, 'noremopyh'
    cases = [
        (word, f"<answer>{right_word}</answer>", 1.0),
        (word, f"<answer> {right_word} </answer>", 1.0),  # the package's extractor strips
        (word, f"<answer>{right_word[:-1]}#</answer>", (len(right_word) - 1) / len(right_word)),  # in place
        (word, f"<answer>{right_word.upper()}</answer>", 1.0),  # the family ignores case
        # every letter in place and one more: the family means 1 - 0.2, but nine 1/9 add up to 0.999...,
        # not 1.0, so it gives ~1.0 (its own score, kept as it is)
        (word, f"<answer>{right_word}s</answer>", sum([1 / 9] * 9)),
        (word, "<answer>zzz</answer>", 0.0),
        (word, f"<answer>zzz</answer> then <answer>{right_word}</answer>", 1.0),  # the last tag counts
        (word, f"{right_word}", 0.0),  # no tags: no answer
        (word, f"<answer>{right_word}", 0.0),  # malformed: unclosed
        (sum_, f"<answer>{right_sum}</answer>", 1.0),
        (sum_, f"<answer>{right_sum}0</answer>", len(right_sum) / (len(right_sum) + 1)),  # partial
        (sum_, "<answer></answer>", 0.0),
    ]
    scores = ReasoningGymScore()([p for p, _, _ in cases], [c for _, c, _ in cases])
    assert scores.dtype == torch.float32
    for (prompt, completion, expected), got in zip(cases, scores.tolist()):
        assert got == pytest.approx(expected, abs=1e-6), completion
        assert got == pytest.approx(package_score(prompt, completion), abs=1e-6), completion


def test_the_final_extractor_reads_an_untagged_answer_for_the_same_scorer():
    (sum_,), _ = reasoning_gym_task("chain_sum", 1, 0, seed=0)
    prose = f"Adding them up gives {sum_.target}."
    completions = [prose, f"<answer>{sum_.target}</answer> not 5", f"\\boxed{{{sum_.target}}}", "no number"]
    final = ReasoningGymScore(extract="final")([sum_] * 4, completions).tolist()
    assert final == [1.0, 1.0, 1.0, 0.0]
    assert ReasoningGymScore()([sum_] * 4, completions).tolist() == [0.0, 1.0, 0.0, 0.0]  # tags only
    with pytest.raises(ValueError, match=r"extract='last' must be 'tags'"):
        ReasoningGymScore(extract="last")


def test_a_prompt_of_another_source_scores_none():
    train, _ = reasoning_gym_task("chain_sum", 2, 0, seed=1)
    reward = ReasoningGymScore(weight=0.5)
    right = f"<answer>{train[0].target}</answer>"
    scores = reward([train[0], Prompt("2+2?", target="4"), train[1]], [right, "<answer>4</answer>", right])
    assert scores[0] == 1.0 and math.isnan(scores[1]) and scores[2] == 0.0
    assert reward.allows_none and reward.weight == 0.5 and reward.name == "reasoning_gym_score"
    assert reward.check(Prompt("2+2?")) is None and reward.check(train[0]) is None
    broken = Prompt("q", metadata={"reasoning_gym": {"family": "no_such_family", "config": {}}, "entry": {}})
    assert "not a reasoning-gym family" in reward.check(broken)


# -- the splits -------------------------------------------------------------------------------------


def test_two_seeds_are_not_two_splits_so_the_held_out_split_is_cut_from_one_stream():
    """Item i of seed 1 is item i + 1 of seed 0 in chain_sum: 'train on seed 0, test on seed 1' would test
    on training questions. Here the held-out questions are the stream's first, training the next."""
    seed0 = [e["question"] for e in reasoning_gym.create_dataset("chain_sum", seed=0, size=50)]
    seed1 = [e["question"] for e in reasoning_gym.create_dataset("chain_sum", seed=1, size=50)]
    assert len(set(seed0) & set(seed1)) >= 45
    train, test = reasoning_gym_task("chain_sum", 40, 10, seed=0)
    assert questions(test) == seed0[:10] and questions(train) == seed0[10:50]
    assert not set(questions(train)) & set(questions(test))


def test_a_repeating_generator_is_deduplicated_by_question_text():
    """Narrow chain_sum has 200 questions; 120 draws hold repeats, so more are drawn, and none is kept
    twice or in both splits. Asking for more than exist says so."""
    draws = [e["question"] for e in reasoning_gym.create_dataset("chain_sum", seed=0, size=120, **NARROW)]
    assert len(set(draws)) < 120  # the generator repeats itself
    train, test = reasoning_gym_task("chain_sum", 100, 20, seed=0, config=NARROW)
    assert len(set(questions(train))) == 100 and len(set(questions(test))) == 20
    assert not set(questions(train)) & set(questions(test))
    assert questions(test) == list(dict.fromkeys(draws))[:20]  # the first distinct questions of the stream
    with pytest.raises(DataError, match=r"distinct new questions, fewer than num_train \+ num_test = 201"):
        reasoning_gym_task("chain_sum", 181, 20, seed=0, config=NARROW)


def test_the_same_seed_gives_the_same_prompts_and_another_seed_others():
    first = reasoning_gym_task("leg_counting", 6, 3, seed=7, config={"min_animals": 2})
    again = reasoning_gym_task("leg_counting", 6, 3, seed=7, config={"min_animals": 2})
    other = reasoning_gym_task("leg_counting", 6, 3, seed=8, config={"min_animals": 2})
    assert [questions(s) for s in first] == [questions(s) for s in again]
    assert questions(first[1]) != questions(other[1])
    prompt = first[0][0]
    assert prompt.target == prompt.metadata["entry"]["answer"]
    assert prompt.metadata["reasoning_gym"]["config"]["min_animals"] == 2
    assert prompt.metadata["reasoning_gym"]["config"]["seed"] == 7
    assert prompt.content[0] == {"role": "system", "content": reasoning_gym.utils.SYSTEM_PROMPTS["default"]}
    assert prompt.content[1]["content"] == prompt.question == prompt.metadata["entry"]["question"]
    plain, _ = reasoning_gym_task("leg_counting", 1, 0, seed=7, system_prompt=None)
    assert isinstance(plain[0].content, str)


def test_bad_arguments_name_the_value_and_the_fix():
    with pytest.raises(DataError, match=r"family='leg_countin' is not a reasoning-gym family; did you mean "
                                        r"leg_counting"):
        reasoning_gym_task("leg_countin", 1, 1)
    with pytest.raises(DataError, match=r"config\['seed'\]=3: the seed is set by the task"):
        reasoning_gym_task("chain_sum", 1, 1, config={"seed": 3})
    with pytest.raises(DataError, match=r"cannot build 'chain_sum' with config \{'min_terms': 9, "):
        reasoning_gym_task("chain_sum", 1, 1, config={"min_terms": 9, "max_terms": 2})
    with pytest.raises(DataError, match=r"num_train=-1 must be an int >= 0"):
        reasoning_gym_task("chain_sum", -1, 1)
    with pytest.raises(DataError, match=r"the weight of 'gcd' is 0; a weight is a number > 0"):
        reasoning_gym_task([{"name": "chain_sum"}, {"name": "gcd", "weight": 0}], 1, 1)


# -- composites -------------------------------------------------------------------------------------


def test_a_composite_draws_each_family_by_its_weight_and_scores_each_with_its_own_scorer():
    """Weights 3 : 1 over 2,000 draws: chain_sum expected 1,500, standard deviation sqrt(2000 * 3/16) =
    19.4; within 4 of them."""
    specs = [{"name": "chain_sum", "weight": 3}, {"name": "gcd", "weight": 1, "config": {"max_value": 500}}]
    train, test = reasoning_gym_task(specs, 2000, 0, seed=0)
    counts = Counter(p.metadata["reasoning_gym"]["family"] for p in train)
    assert counts.keys() == {"chain_sum", "gcd"} and abs(counts["chain_sum"] - 1500) <= 4 * 19.4
    assert all(p.metadata["reasoning_gym"]["family"] == p.metadata["entry"]["metadata"]["source_dataset"]
               for p in train)
    gcd = next(p for p in train if p.metadata["reasoning_gym"]["family"] == "gcd")
    assert gcd.metadata["reasoning_gym"]["config"]["max_value"] == 500
    assert gcd.metadata["reasoning_gym"]["config"]["seed"] == 2  # the composite's seed + its place + 1
    mixed = train[:40]
    answers = [f"<answer>{p.target}</answer>" for p in mixed]
    assert ReasoningGymScore()(mixed, answers).tolist() == [1.0] * 40
    assert [package_score(p, a) for p, a in zip(mixed, answers)] == [1.0] * 40


# -- the difficulty curriculum ----------------------------------------------------------------------


def curriculum(**changes):
    settings = dict(batch_size=2, num_train=8, num_test=4, seed=0, window=4, threshold=0.75)
    return DifficultyCurriculum("chain_sum", **{**settings, **changes})


def test_the_level_rises_when_the_windows_mean_reaches_the_threshold():
    from grpo_engine.protocols import PromptSource, RewardFn

    source = curriculum()
    assert isinstance(source, PromptSource) and isinstance(ReasoningGymScore(), RewardFn)
    assert source.level == 0
    assert not source.update([1.0, 1.0])  # 2 groups of a window of 4: not yet
    assert source.update([0.5, 0.5]) and source.level == 1  # (1 + 1 + .5 + .5) / 4 = 0.75
    assert not source.update([1.0, 1.0, 1.0])  # the window emptied: 3 groups
    assert source.update([0.0]) and source.level == 2  # 3 / 4 = 0.75
    assert not source.update([0.0, 0.0, 0.0, 0.0])  # 0
    assert not source.update([1.0, 1.0])  # the last 4: 0, 0, 1, 1 -> 0.5
    assert source.update([1.0]) and source.level == 3  # the last 4: 0, 1, 1, 1 -> 0.75
    capped = curriculum(max_level=1)
    capped.update([1.0] * 4)
    assert capped.level == 1 and not capped.update([1.0] * 4) and capped.level == 1


def test_each_level_is_the_familys_curriculum_level_and_no_question_is_reused():
    source = curriculum()
    level0 = source.next_batch()
    source.update([1.0] * 4)
    level1 = source.next_batch(8)
    assert {p.metadata["reasoning_gym"]["config"]["max_terms"] for p in level0} == {2}  # chain_sum level 0
    config = level1[0].metadata["reasoning_gym"]["config"]
    assert (config["max_terms"], config["max_digits"]) == (3, 2)  # its curriculum's level 1, inclusive
    assert set(questions(level1)) == set(questions(source.split()[0]))  # one epoch: all 8
    every = [q for level in (0, 1) for pool in source.split(level) for q in questions(pool)]
    assert len(every) == 2 * (8 + 4) and len(set(every)) == len(every)
    assert questions(source.prompts) == questions(source.split(0)[0] + source.split(1)[0])
    with pytest.raises(ValueError, match=r"level=2 has not been reached; levels 0..1 have problems so far"):
        source.split(2)


def test_observe_takes_the_group_accuracy_of_the_current_levels_groups():
    source = curriculum(window=3)
    batch = source.next_batch(3)
    scores = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.5, 0.5]])  # group means 1, 0.5, 0.5 -> 2/3
    source.observe(SimpleNamespace(prompts=batch), RewardOutput(scores, {"reasoning_gym_score": scores}))
    assert source.level == 0 and source.state_dict()["window"] == [1.0, 0.5, 0.5]
    source.threshold = 0.6
    source.observe(SimpleNamespace(prompts=batch[:1]), RewardOutput(scores[:1], {"reasoning_gym_score":
                                                                                  scores[:1]}))
    assert source.level == 1  # 0.5, 0.5, 1 -> 2/3 >= 0.6
    source.observe(SimpleNamespace(prompts=batch), RewardOutput(scores, {"reasoning_gym_score": scores}))
    assert source.state_dict()["window"] == []  # level 0's prompts no longer count


def test_a_resumed_curriculum_serves_what_the_uninterrupted_one_would():
    whole = curriculum()
    whole.next_batch()
    whole.update([1.0] * 4)
    whole.next_batch(5)
    whole.update([0.5])
    state = json.loads(json.dumps(whole.state_dict()))
    resumed = curriculum()
    resumed.load_state_dict(state)
    assert resumed.level == 1 and resumed.state_dict() == whole.state_dict()
    for _ in range(3):  # across the epoch boundary
        assert questions(resumed.next_batch()) == questions(whole.next_batch())
    with pytest.raises(DataError, match=r"state_dict seed=0 but this DifficultyCurriculum has seed=1"):
        curriculum(seed=1).load_state_dict(state)


def test_bad_curriculum_arguments_are_listed_at_once():
    with pytest.raises(DataError, match=r"window=0 must be an int >= 1; threshold=1.5 must be in \(0, 1\]"):
        curriculum(window=0, threshold=1.5)
    with pytest.raises(DataError, match=r"max_level=99 must be an int from start_level=0 to the family's "
                                        r"highest level, 10"):
        curriculum(max_level=99)


@pytest.mark.filterwarnings("ignore:step \\d+. every group has identical rewards")
def test_the_trainer_drives_the_level(tiny_folder, tmp_path):
    """A scripted accuracy of 1 on every completion, a window of 2 groups (one step's): the level rises
    after each step, so two steps end at level 2."""
    from grpo_engine import GRPOConfig, GRPOTrainer
    from grpo_engine.data.templates import ChatTemplate

    def always_right(completions, **columns):
        return [1.0] * len(completions)

    source = DifficultyCurriculum("chain_sum", 2, num_train=4, num_test=2, window=2, threshold=1.0,
                                  system_prompt=None, accuracy_reward="always_right")
    config = GRPOConfig(prompts_per_step=2, group_size=2, max_completion_tokens=4, max_prompt_tokens=128,
                        max_steps=2, output_dir=str(tmp_path), progress_bar=False)
    trainer = GRPOTrainer(str(tiny_folder), [ReasoningGymScore(), always_right], source, config,
                          template=ChatTemplate())
    history = trainer.train()
    assert source.level == 2 and len(history) == 2
    assert all(h["reward/reasoning_gym_score/mean"] == 0.0 for h in history)  # random weights: no tags


# -- run files, the CLI, the demo, the missing extra ------------------------------------------------


def test_a_run_file_builds_the_task_the_curriculum_and_the_reward():
    from grpo_engine.spec import RunSpec, build, rewards_of

    spec = RunSpec.model_validate({
        "model": "m",
        "train_prompts": {"function": "grpo_engine.tasks.reasoning_gym_task", "family": "leg_counting",
                          "num_train": 5, "num_test": 2, "seed": 3, "config": {"min_animals": 2}},
        "rewards": [{"class": "grpo_engine.tasks.ReasoningGymScore"}]})
    train, test = build(spec.train_prompts)
    assert (train, test) == reasoning_gym_task("leg_counting", 5, 2, seed=3, config={"min_animals": 2})
    (reward,) = rewards_of(spec)
    assert isinstance(reward, ReasoningGymScore)
    source = build(RunSpec.model_validate({
        "model": "m", "rewards": [],
        "train_prompts": {"class": "grpo_engine.tasks.DifficultyCurriculum", "family": "chain_sum",
                          "batch_size": 4, "num_train": 8, "num_test": 2, "window": 8}}).train_prompts)
    assert isinstance(source, DifficultyCurriculum) and source.window == 8 and len(source.next_batch()) == 4


def test_the_demo_takes_a_reasoning_gym_family(capsys):
    from grpo_engine.cli import build_parser
    from grpo_engine.demo import DemoSettings, demo_reward, demo_task

    parse = build_parser().parse_args
    assert parse(["demo", "--task", "rg:leg_counting"]).task == "leg_counting"
    assert parse(["demo", "--task", "leg_counting"]).task == "leg_counting"
    assert parse(["demo", "--task", "comparison"]).task == "comparison"
    assert parse(["demo"]).task == "arithmetic"
    with pytest.raises(SystemExit):
        parse(["demo", "--task", "rg:leg_countin"])
    assert "did you mean leg_counting" in capsys.readouterr().err
    config = parse(["demo", "--task", "gcd", "--task-config", '{"max_value": 30}']).task_config
    assert config == {"max_value": 30}
    assert parse(["demo"]).task_config is None
    for bad in ("{max_value: 30}", "[30]"):
        with pytest.raises(SystemExit):
            parse(["demo", "--task", "gcd", "--task-config", bad])
        assert "pass an object" in capsys.readouterr().err
    settings = DemoSettings(task="leg_counting", task_config={"min_animals": 2}, num_train=4, num_test=2,
                            seed=1)
    train, test = demo_task(settings)
    # the bare question (no system prompt), under the family's config
    assert (train, test) == reasoning_gym_task("leg_counting", 4, 2, seed=1, config={"min_animals": 2},
                                               system_prompt=None)
    assert all(p.metadata["reasoning_gym"]["config"]["min_animals"] == 2 for p in train + test)
    reward = demo_reward(settings)
    assert isinstance(reward, ReasoningGymScore) and reward.extract == "final"
    # the final answer, no tags: a bare number scores 1, another scores 0
    assert reward(train[:1] * 2, [f"It is {train[0].target}.", "It is -1."]).tolist() == [1.0, 0.0]
    from grpo_engine.demo import demo_template

    assert demo_template(settings).instruction == " Reply with only the final answer."
    assert demo_template(DemoSettings(task="comparison")).instruction == " Reply with only the final number."
    assert type(demo_reward(DemoSettings(task="comparison"))).__name__ == "MathAccuracy"
    with pytest.raises(ValueError, match=r"task_config=\{'max_value': 3\} is for a reasoning-gym family; "
                                         r"the built-in task 'arithmetic' takes none"):
        demo_task(DemoSettings(task_config={"max_value": 3}))


def test_without_the_extra_every_entry_point_gives_the_install_line(monkeypatch, capsys):
    from grpo_engine.cli import build_parser

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym now raises ImportError
    install = "pip install 'grpo-engine[tasks]'"
    with pytest.raises(ImportError, match=r"need the package reasoning-gym, which is not installed; install "
                                          r"the extra: pip install 'grpo-engine\[tasks\]'"):
        reasoning_gym_task("chain_sum", 1, 1)
    for build in (ReasoningGymScore, lambda: DifficultyCurriculum("chain_sum")):
        with pytest.raises(ImportError, match=r"grpo-engine\[tasks\]"):
            build()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--task", "leg_counting"])
    assert install in capsys.readouterr().err
    from grpo_engine.demo import DemoSettings, demo_task

    with pytest.raises(ImportError, match=r"grpo-engine\[tasks\]"):
        demo_task(DemoSettings(task="leg_counting"))
    assert build_parser().parse_args(["demo", "--task", "arithmetic"]).task == "arithmetic"  # needs nothing
