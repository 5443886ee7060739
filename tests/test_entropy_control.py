"""AdaptiveTemperature and InformativeCurriculum under scripted entropy / accuracy sequences."""

import json

import pytest
import torch

from grpo_engine.data.curriculum import InformativeCurriculum, PromptStats
from grpo_engine.entropy.control import AdaptiveTemperature, collapsed_fraction, collapsed_groups
from grpo_engine.types import Prompt

T = torch.tensor
COLLAPSED = (T([0.0, 0.05, 0.1, 0.6]), T([0.0, 0.25, 0.0, 0.5]))  # 3 of 4 collapsed (SE <= 0.1, acc < 1)
SCATTERED = (T([0.9, 0.8, 1.0, 0.7]), T([0.25, 0.0, 0.5, 0.5]))  # mean SE 0.85 >= 0.8, none collapsed
MIXED = (T([0.0, 0.0, 0.5, 0.6]), T([0.0, 0.0, 0.5, 0.5]))  # exactly half collapsed, mean SE 0.275
SOLVED = (T([0.0, 0.0, 0.0, 0.0]), T([1.0, 1.0, 1.0, 1.0]))  # agree on the right answer: not collapsed


# -- collapse ----------------------------------------------------------------------------------

def test_collapsed_groups_boundaries():
    """SE == threshold counts as collapsed; accuracy 1 never does; NaN SE never does."""
    se = T([0.1, 0.1000001, 0.0, 0.0, float("nan")])
    acc = T([0.75, 0.0, 1.0, 0.999, 0.0])
    assert collapsed_groups(se, acc, 0.1).tolist() == [True, False, False, True, False]
    assert collapsed_fraction(se, acc, 0.1).item() == pytest.approx(0.4)
    assert collapsed_fraction(*COLLAPSED).item() == 0.75 and collapsed_fraction(*SOLVED).item() == 0.0
    with pytest.raises(ValueError, match=r"must both be \[B\] with B >= 1"):
        collapsed_fraction(T([0.0, 0.1]), T([0.0]))


# -- AdaptiveTemperature -----------------------------------------------------------------------

def run(control, script):
    return [control.update(*inputs) for inputs in script]


def test_collapse_raises_by_step_then_clips_at_max():
    control = AdaptiveTemperature(initial=1.0, max_temperature=1.15, step=0.05)
    assert run(control, [COLLAPSED] * 5) == [1.05, 1.1, 1.15, 1.15, 1.15]
    assert control.temperature == 1.15


def test_scatter_lowers_by_step_then_clips_at_min():
    control = AdaptiveTemperature(initial=0.7, min_temperature=0.5, step=0.1)
    assert run(control, [SCATTERED] * 4) == [0.6, 0.5, 0.5, 0.5]


def test_mixed_or_solved_keeps_the_temperature():
    control = AdaptiveTemperature(initial=0.9)
    assert run(control, [MIXED, SOLVED, MIXED]) == [0.9, 0.9, 0.9]


def test_scripted_sequence_up_down_and_back():
    """+step, +step, keep, -step, -step, -step, +step on the 0.05 grid, no drift."""
    control = AdaptiveTemperature(initial=1.0, min_temperature=0.9, max_temperature=1.5, step=0.05)
    script = [COLLAPSED, COLLAPSED, MIXED, SCATTERED, SCATTERED, SCATTERED, SCATTERED, COLLAPSED]
    assert run(control, script) == [1.05, 1.1, 1.1, 1.05, 1.0, 0.95, 0.9, 0.95]


def test_collapse_is_checked_before_scatter():
    """With scatter_entropy 0.3 both fire on this batch (3/4 collapsed, mean SE 0.35): raise."""
    se, acc = T([0.0, 0.0, 0.0, 1.4]), T([0.0, 0.0, 0.0, 0.0])
    assert AdaptiveTemperature(initial=1.0, step=0.1, scatter_entropy=0.3).update(se, acc) == 1.1


def test_collapse_fraction_threshold_is_strict():
    control = AdaptiveTemperature(initial=1.0, step=0.1, collapse_fraction=0.25)
    assert control.update(*MIXED) == 1.1  # 0.5 > 0.25
    assert control.update(T([0.0, 0.5, 0.5, 0.5]), T([0.0, 0.5, 0.5, 0.5])) == 1.1  # 0.25 is not > 0.25


def test_temperature_state_dict_round_trip():
    script = [COLLAPSED, SCATTERED, COLLAPSED, COLLAPSED, MIXED, SCATTERED]
    a = AdaptiveTemperature(initial=1.0)
    run(a, script[:3])
    b = AdaptiveTemperature(initial=1.0)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.temperature == a.temperature == 1.05
    assert run(a, script[3:]) == run(b, script[3:])
    with pytest.raises(ValueError, match=r"state temperature=2.0 is outside \[0.5, 1.5\]"):
        b.load_state_dict({"temperature": 2.0})


@pytest.mark.parametrize("kwargs, message", [
    (dict(min_temperature=0.0), r"min_temperature=0.0, max_temperature=1.5 must satisfy 0 < min <= max"),
    (dict(initial=2.0), r"initial=2.0 must be within \[0.5, 1.5\]"),
    (dict(step=0.0, collapse_entropy=0.9),
     r"step=0.0 must be > 0.*collapse_entropy=0.9, scatter_entropy=0.8"),
    (dict(collapse_fraction=1.0), r"collapse_fraction=1.0 must be in \[0, 1\)"),
])
def test_temperature_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveTemperature(**kwargs)


# -- InformativeCurriculum ---------------------------------------------------------------------

PROMPTS = [Prompt(f"q{i}", str(i), metadata={"id": i}) for i in range(12)]  # metadata: unhashable


def ids(batch):
    return [int(p.target) for p in batch]


def accuracy_of(i):
    """A fixed difficulty profile: 0, 1/4, 1/2, 3/4, 1, 0, ... by prompt id."""
    return [0.0, 0.25, 0.5, 0.75, 1.0][i % 5]


def drive(curriculum, steps, size=None, se=None):
    """Serves ``steps`` batches, reporting each prompt's scripted accuracy (and SE)."""
    batches = []
    for _ in range(steps):
        batch = curriculum.next_batch(size)
        batches.append(ids(batch))
        acc = T([accuracy_of(i) for i in ids(batch)])
        curriculum.update(batch, acc, None if se is None else T([se(i) for i in ids(batch)]))
    return batches


def test_unseen_prompts_come_first_and_every_prompt_once_per_pass():
    """Until every prompt was served once, the non-revisit part of each batch is new prompts."""
    cur = InformativeCurriculum(PROMPTS, batch_size=4, seed=3)
    seen, served_before_all_seen = set(), []
    while len(seen) < len(PROMPTS):
        revisits = set(cur.informative())
        batch = ids(cur.next_batch())
        fresh = [i for i in batch if i not in revisits]
        assert not seen & set(fresh), "a fresh slot served a prompt that was already seen"
        assert len(fresh) >= 2  # at most floor(0.5 * 4) revisits
        seen |= set(batch)
        served_before_all_seen.append(batch)
        cur.update([PROMPTS[i] for i in batch], T([accuracy_of(i) for i in batch]))
    assert cur.epoch == 0 and len(served_before_all_seen) >= 3


def test_revisits_are_informative_only_and_most_informative_first():
    """With every prompt scored once, the informative prompts (mean accuracy in (0.1, 0.9)) are
    those with accuracy 1/4, 1/2, 3/4; hopeless (0) and solved (1) ones are never revisited.
    The two revisit slots go to accuracy 1/2 first (prompts 2 and 7), then to the 1/4, 3/4 ones."""
    cur = InformativeCurriculum(PROMPTS, batch_size=4, seed=0, cooldown_batches=0)
    cur.update(PROMPTS, T([accuracy_of(i) for i in range(12)]))
    informative = [1, 2, 3, 6, 7, 8, 11]
    assert sorted(cur.informative()) == informative
    batch = ids(cur.next_batch())
    assert sorted(batch[:2]) == [2, 7]
    cur = InformativeCurriculum(PROMPTS, batch_size=4, seed=0, cooldown_batches=1)
    cur.update(PROMPTS, T([accuracy_of(i) for i in range(12)]))
    first, second = ids(cur.next_batch()), ids(cur.next_batch())
    assert sorted(first[:2]) == [2, 7] and set(second[:2]) <= {1, 3, 6, 8, 11}  # 2 and 7 cool down
    for batch in drive(cur, 30):
        assert set(batch[:2]) <= set(informative)  # the revisit slots (always enough candidates here)


def test_ties_go_to_higher_semantic_entropy_then_seeded_random():
    """Prompts 1 and 3 (accuracies 1/4 and 3/4) tie on distance to 1/2; SE breaks the tie."""
    def cur_with(se_of, seed=0):
        cur = InformativeCurriculum(PROMPTS[:4], batch_size=2, seed=seed, revisit_fraction=0.5,
                                    cooldown_batches=0)
        cur.update([PROMPTS[1], PROMPTS[3]], T([0.25, 0.75]), se_of)
        return cur

    assert ids(cur_with(T([0.2, 0.9])).next_batch())[0] == 3
    assert ids(cur_with(T([0.9, 0.2])).next_batch())[0] == 1
    assert ids(cur_with(None).next_batch())[0] in (1, 3)
    firsts = {ids(cur_with(None, seed).next_batch())[0] for seed in range(20)}
    assert firsts == {1, 3}  # an exact tie is broken at random, by the seed
    assert all(ids(cur_with(None, s).next_batch()) == ids(cur_with(None, s).next_batch()) for s in range(5))


def test_cooldown_keeps_a_revisit_out_for_that_many_batches():
    cur = InformativeCurriculum(PROMPTS, batch_size=2, seed=0, cooldown_batches=2)
    first = cur.next_batch()
    cur.update(first, T([0.5, 0.0]))
    hit = [ids(first)[0] in ids(cur.next_batch()) for _ in range(4)]
    assert hit == [False, False, True, False]  # served in batch 0; revisited in batch 3; then cooling again


def test_deterministic_per_seed_and_seed_matters():
    se = lambda i: (i % 3) / 2  # noqa: E731
    a = drive(InformativeCurriculum(PROMPTS, 5, seed=7), 20, se=se)
    b = drive(InformativeCurriculum(PROMPTS, 5, seed=7), 20, se=se)
    c = drive(InformativeCurriculum(PROMPTS, 5, seed=8), 20, se=se)
    assert a == b and a != c


@pytest.mark.parametrize("size", [1, 5, 11, 12])
def test_never_a_duplicate_within_a_batch(size):
    cur = InformativeCurriculum(PROMPTS, batch_size=size, seed=1, revisit_fraction=0.75, cooldown_batches=0)
    g = torch.Generator().manual_seed(size)
    for _ in range(40):
        batch = cur.next_batch()
        assert len(batch) == size and len(set(ids(batch))) == size
        cur.update(batch, torch.randint(0, 5, (size,), generator=g) / 4, torch.rand(size, generator=g))


def test_without_revisits_it_serves_whole_passes():
    cur = InformativeCurriculum(PROMPTS, batch_size=4, seed=0, revisit_fraction=0.0)
    for _ in range(2):
        served = sum(drive(cur, 3), [])
        assert sorted(served) == list(range(12))


def test_curriculum_state_dict_round_trip_continues_exactly():
    se = lambda i: (i % 4) / 3  # noqa: E731
    a = InformativeCurriculum(PROMPTS, batch_size=5, seed=2)
    drive(a, 7, se=se)
    b = InformativeCurriculum(PROMPTS, batch_size=5, seed=2)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert (b.epoch, b.position) == (a.epoch, a.position)
    assert drive(a, 10, se=se) == drive(b, 10, se=se)
    with pytest.raises(ValueError, match=r"state_dict seed=2 but this InformativeCurriculum has seed=3"):
        InformativeCurriculum(PROMPTS, batch_size=5, seed=3).load_state_dict(a.state_dict())


def test_statistics_keyed_by_position_with_equality_fallback():
    cur = InformativeCurriculum(PROMPTS, batch_size=2)
    cur.update([PROMPTS[4]], [1.0], [0.0])
    cur.update([Prompt("q4", "4", metadata={"id": 4})], T([0.0]))  # an equal copy: same prompt
    assert cur.stats(PROMPTS[4]) == PromptStats(visits=2, mean_accuracy=0.5, last_accuracy=0.0,
                                                last_semantic_entropy=0.0, last_served=-1)
    assert cur.stats(0) == PromptStats()
    with pytest.raises(ValueError, match=r"prompt 'elsewhere' is not one of this curriculum's prompts"):
        cur.update([Prompt("elsewhere")], [0.5])
    with pytest.raises(ValueError, match=r"got 1 prompts, 2 accuracies"):
        cur.update([PROMPTS[0]], [0.5, 0.5])
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\]"):
        cur.update([PROMPTS[0]], [1.5])


def test_curriculum_validation():
    with pytest.raises(ValueError, match=r"batch_size=13 must be an int in \[1, len\(prompts\)=12\].*"
                                         r"target_low=0.5, target_high=0.5"):
        InformativeCurriculum(PROMPTS, batch_size=13, target_low=0.5, target_high=0.5)
    with pytest.raises(ValueError, match=r"revisit_fraction=1.5.*cooldown_batches=-1"):
        InformativeCurriculum(PROMPTS, batch_size=2, revisit_fraction=1.5, cooldown_batches=-1)
    with pytest.raises(ValueError, match=r"size=13 must be in \[1, 12\]"):
        InformativeCurriculum(PROMPTS, batch_size=2).next_batch(13)


def test_drop_in_prompt_source_for_the_trainer(tmp_path):
    """The trainer only calls next_batch(k): a curriculum runs a step in place of PromptStream."""
    from tests.test_trainer import PROMPTS as TRAIN
    from tests.test_trainer import make_trainer

    trainer = make_trainer(tmp_path, max_steps=1)
    trainer.prompts = InformativeCurriculum(TRAIN, batch_size=trainer.config.prompts_per_step, seed=0)
    metrics = trainer.step()
    assert trainer.prompts.position == trainer.config.prompts_per_step and "loss" in metrics
