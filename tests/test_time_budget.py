"""A calibrated time budget: the warm-up steps are timed, the run's step count is fixed from them, and the
schedule follows steps, so the same seed gives the same run on machines of slightly different speed,
and a slower machine runs fewer steps inside the same budget."""

from __future__ import annotations

import math

import pytest

from grpo_engine import GRPOConfig, Reward
from grpo_engine.callbacks import TrainerState
from grpo_engine.config import ConfigError, lr_factor, peak_learning_rate, planned_steps
from tests.test_trainer import make_trainer


class TiedFirst(Reward):
    """The share of digits in a completion (groups of a random model rarely tie), but 0 for every
    completion of the first ``steps`` steps (8 completions a step), so that those steps update nothing."""

    def __init__(self, steps: int) -> None:
        self.left = 8 * steps

    def score(self, prompt, completion):
        self.left -= 1
        return 0.0 if self.left >= 0 else sum(c.isdigit() for c in completion) / max(1, len(completion))


def clocked(trainer, monkeypatch, seconds_per_sample, seconds_per_update: float = 0.0) -> list[float]:
    """A fake clock that moves ``seconds_per_sample`` (a number, or a function of the steps done)
    whenever the trainer samples, ``seconds_per_update`` whenever it runs a micro-batch's forward and
    backward, and not otherwise."""
    import grpo_engine.logging as logging_module

    now = [100.0]
    monkeypatch.setattr(logging_module.time, "perf_counter", lambda: now[0])
    sample = trainer.sampler.sample

    def slow_sample(*args, **kwargs):
        step = trainer.state.step
        now[0] += seconds_per_sample(step) if callable(seconds_per_sample) else seconds_per_sample
        return sample(*args, **kwargs)

    trainer.sampler.sample = slow_sample
    micro_step = trainer.gradients._micro_step

    def slow_micro_step(*args, **kwargs):
        now[0] += seconds_per_update
        return micro_step(*args, **kwargs)

    trainer.gradients._micro_step = slow_micro_step
    return now


def calibrated(tmp_path, **changes):
    settings = dict(lr_schedule="cosine", max_steps=1000, max_train_seconds=100.0, warmup_steps=2,
                    time_budget="calibrated", learning_rate=0.3, output_dir=str(tmp_path))
    return make_trainer(tmp_path, **{**settings, **changes})


def test_the_warm_up_fixes_the_steps_and_the_schedule_follows_them(tmp_path, monkeypatch):
    """10 s a step: after 2 warm-up steps (20 s), 0.95 x 80 s fit 7 more steps, so 9 in all (below 20
    they are not rounded); lr: warm-up (s + 1) / 3, then cosine over (s - 2) / (9 - 2)."""
    trainer = calibrated(tmp_path / "run")
    clocked(trainer, monkeypatch, 10.0)
    history = trainer.train()
    want = [0.1, 0.2] + [0.15 * (1 + math.cos(math.pi * k / 7)) for k in range(7)]
    assert trainer.state.planned_steps == 9 and trainer.step_count == 9
    assert [m["lr"] for m in history] == pytest.approx(want)
    assert trainer.train_seconds == pytest.approx(90.0)


def test_the_same_seed_gives_the_same_run_on_a_slightly_slower_machine_and_fewer_steps_on_a_slow_one(
        tmp_path, monkeypatch):
    runs = {}
    for speed in (10.0, 10.4, 20.0):
        trainer = calibrated(tmp_path / str(speed), max_train_seconds=300.0)
        clocked(trainer, monkeypatch, speed)
        history = trainer.train()
        runs[speed] = [{k: v for k, v in m.items() if not k.startswith(("time/", "tokens/generated_"))}
                       for m in history]
        assert trainer.train_seconds <= 300.0
    # 10 s: 2 + int(0.95 x 280 / 10) = 28 -> 20; 10.4 s: 2 + 25 = 27 -> 20;
    # 20 s: 2 + int(0.95 x 260 / 20) = 14
    assert len(runs[10.0]) == len(runs[10.4]) == 20 and len(runs[20.0]) == 14
    assert runs[10.0] == runs[10.4]  # every metric of every step, exactly


def test_a_calibrated_run_resumes_with_its_planned_steps(tmp_path, monkeypatch):
    trainer = calibrated(tmp_path, save_every_steps=3)
    clocked(trainer, monkeypatch, 10.0)
    trainer.train()
    resumed = calibrated(tmp_path, save_every_steps=3,
                         components={"resume_from": str(tmp_path / "checkpoint-6")})
    assert resumed.state.planned_steps == 9 and resumed.step_count == 6


def test_the_warm_up_times_an_update_from_the_steps_that_ran_one(tmp_path, monkeypatch):
    """Sampling 10 s, an update 10 s more, and the first step's groups all tie (no update): the warm-up
    took 10 + 20 s. Its mean (15 s) would plan 2 + int(0.95 x 270 / 15) = 19 steps, which the 300 s
    budget cuts at 16; the calibration counts 20 s a step: 2 + int(0.95 x 270 / 20) = 14, all of them
    inside the budget."""
    trainer = calibrated(tmp_path, max_train_seconds=300.0, rewards=[TiedFirst(steps=1)], learning_rate=3e-3)
    clocked(trainer, monkeypatch, 10.0, seconds_per_update=10.0)
    history = trainer.train()
    assert [m["time/step_s"] for m in history[:2]] == [10.0, 20.0]
    assert trainer.state.planned_steps == 14 and trainer.step_count == 14
    assert trainer.state.update_steps == 13 and trainer.train_seconds == pytest.approx(270.0)


def test_a_warm_up_without_an_update_plans_at_the_first_step_that_updates(tmp_path, monkeypatch):
    """The groups tie in steps 1-3; step 4 is the first to update: 10 + 10 + 10 + 20 s, so
    (50 - 10) / 4 + 10 = 20 s a step and 4 + int(0.95 x 250 / 20) = 15 steps. Until then the schedule
    follows the step fraction of max_steps (never the clock, so the same seed gives the same rates)."""
    trainer = calibrated(tmp_path, max_train_seconds=300.0, rewards=[TiedFirst(steps=3)], learning_rate=3e-3)
    clocked(trainer, monkeypatch, 10.0, seconds_per_update=10.0)
    planned = []
    for _ in range(4):
        trainer.step()
        planned.append(trainer.state.planned_steps)
    assert planned == [None, None, None, 15]
    history = trainer.train()
    cosine = [0.0015 * (1 + math.cos(math.pi * k / 998)) for k in (0, 1)]
    cosine += [0.0015 * (1 + math.cos(math.pi * k / 13)) for k in range(2, 13)]
    assert [m["lr"] for m in history] == pytest.approx([0.001, 0.002] + cosine)
    assert trainer.step_count == 15 and trainer.train_seconds == pytest.approx(50.0 + 11 * 20.0)


def shortening(step: int) -> float:
    """10 s a step for the 2 warm-up steps (the base model's long completions), 5 s from then on."""
    return 10.0 if step < 2 else 5.0


def test_a_replan_step_plans_again_from_the_steps_since_the_warm_up(tmp_path, monkeypatch):
    """300 s, 2 warm-up steps of 10 s, then 5 s a step. The warm-up plans 2 + int(0.95 x 280 / 10) = 28
    -> 20 steps, and that run ends at 110 s of its 300; planned again at step 10 (60 s so far, 5 s a step
    since step 2): 10 + int(0.95 x 240 / 5) = 55 -> 50 steps, 260 s. The cosine follows max_steps (1000)
    up to step 10, whatever the first plan (a timing's rough guess), then 50; a run resumed before step 10
    plans the same."""
    first = calibrated(tmp_path / "first", max_train_seconds=300.0)
    clocked(first, monkeypatch, shortening)
    first.train()
    assert first.step_count == 20 and first.train_seconds == pytest.approx(110.0)
    trainer = calibrated(tmp_path / "again", max_train_seconds=300.0, replan_step=10)
    clocked(trainer, monkeypatch, shortening)
    planned = []
    for _ in range(11):
        trainer.step()
        planned.append(trainer.state.planned_steps)
    assert planned == [None] + [20] * 8 + [50, 50]
    assert trainer.state.plan_mark == (2, 20.0, 2, 0.0)
    trainer.train()
    assert trainer.step_count == 50 and trainer.train_seconds == pytest.approx(260.0)
    cosine = [0.15 * (1 + math.cos(math.pi * k / 998)) for k in range(8)]
    cosine += [0.15 * (1 + math.cos(math.pi * k / 48)) for k in range(8, 48)]
    assert [m["lr"] for m in trainer.history] == pytest.approx([0.1, 0.2] + cosine)
    saved = calibrated(tmp_path / "saved", max_train_seconds=300.0, replan_step=10, save_every_steps=5)
    clocked(saved, monkeypatch, shortening)
    assert [m["lr"] for m in saved.train()] == pytest.approx([0.1, 0.2] + cosine)
    resumed = calibrated(tmp_path / "saved", max_train_seconds=300.0, replan_step=10, save_every_steps=5,
                         components={"resume_from": str(tmp_path / "saved" / "checkpoint-5")})
    clocked(resumed, monkeypatch, shortening)
    rest = resumed.train()
    assert resumed.step_count == 50 and [m["lr"] for m in rest] == pytest.approx(cosine[3:])


def test_the_learning_rate_before_the_replan_does_not_depend_on_the_first_plan():
    """Two runs whose warm-ups timed a little differently plan 60 and 70 steps first, and both 80 at the
    replan (step 20): the learning rates of steps 5-20 are the same (max_steps' schedule), those after it
    follow the 80 steps. A first plan that ends the run by the replan is followed from the warm-up on."""
    config = GRPOConfig(max_steps=100, max_train_seconds=400, warmup_steps=4, time_budget="calibrated",
                        replan_step=20, lr_schedule="linear")
    assert [lr_factor(config, s, 0.0, 60) for s in range(4, 20)] == [
        lr_factor(config, s, 0.0, 70) for s in range(4, 20)] == [1 - (s - 4) / 96 for s in range(4, 20)]
    assert [lr_factor(config, s, 0.0, 80) for s in (20, 50)] == pytest.approx([1 - 16 / 76, 1 - 46 / 76])
    assert lr_factor(config, 10, 0.0, 20) == pytest.approx(1 - 6 / 16)  # the run ends at step 20
    assert lr_factor(config, 10, 0.0, 12) == pytest.approx(1 - 6 / 8)
    unplanned = config.model_copy(update={"replan_step": None})
    assert lr_factor(unplanned, 10, 0.0, 60) == pytest.approx(1 - 6 / 56)  # no replan: the first plan holds


def test_plan_grid_rounds_a_short_plan_down_to_its_multiples():
    """400 s, 4 warm-up steps of 4 s (16 s), no update time: 4 + int(0.95 x 384 / 4) = 95 steps fit. The
    default grid of 10 plans 90; a grid of 20, 80; of 1, 95; a grid wider than half of it leaves it."""
    state = TrainerState(step=4, train_seconds=16.0, update_steps=4, update_seconds=0.0)

    def plan(grid):
        return planned_steps(GRPOConfig(max_steps=100, max_train_seconds=400, warmup_steps=4,
                                        time_budget="calibrated", plan_grid=grid), state)

    assert [plan(10), plan(20), plan(1), plan(50)] == [90, 80, 95, 95]
    with pytest.raises(ConfigError, match="plan_grid.*must be >= 1"):
        GRPOConfig(plan_grid=0)


def test_replan_step_needs_a_calibrated_budget_after_the_warm_up():
    with pytest.raises(ConfigError, match="replan_step=20 revises a calibrated budget's plan, and "
                                          "time_budget='clock'"):
        GRPOConfig(replan_step=20, max_train_seconds=450, warmup_steps=4)
    with pytest.raises(ConfigError, match=r"replan_step=4 must come after the warm-up \(warmup_steps=4\)"):
        GRPOConfig(replan_step=4, time_budget="calibrated", max_train_seconds=450, warmup_steps=4)
    config = GRPOConfig(max_steps=120, max_train_seconds=450, warmup_steps=4, time_budget="calibrated",
                        replan_step=20)
    mark = (4, 20.0, 4, 8.0)
    state = TrainerState(step=20, train_seconds=100.0, update_steps=20, update_seconds=40.0, planned_steps=70,
                         plan_mark=mark)
    assert planned_steps(config, state) == 80  # (80 - 32) / 16 + 32 / 16 = 5 s: 20 + int(0.95 x 350 / 5) = 86
    state.update_steps, state.update_seconds = 4, 8.0  # none updated since: 80 / 16 + the mean 2 s = 7 s
    assert planned_steps(config, state) == 60  # 20 + int(0.95 x 350 / 7) = 67 -> 60 (down too)
    state.step = 21
    assert planned_steps(config, state) == 70  # only at replan_step
    state.step, state.planned_steps = 20, 20
    assert planned_steps(config, state) == 20  # a run that ends there is not planned again


def test_planned_steps_rounds_down_to_tens_and_needs_a_budget_and_a_warm_up():
    config = GRPOConfig(max_steps=120, max_train_seconds=450, warmup_steps=4, time_budget="calibrated")

    def plan(step, seconds, update_steps=4, update_seconds=0.0, planned=None, of=config):
        return planned_steps(of, TrainerState(step=step, train_seconds=seconds, update_steps=update_steps,
                                              update_seconds=update_seconds, planned_steps=planned))

    assert plan(4, 12.0) == 120  # 4 + int(0.95 x 438 / 3) = 142 > 120: max_steps
    assert plan(4, 20.0) == 80  # 4 + int(0.95 x 430 / 5) = 85 -> 80
    assert plan(4, 20.0, update_steps=2, update_seconds=4.0) == 70  # 16 / 4 + 4 / 2 = 6 s: 72 -> 70
    assert plan(4, 20.0, update_steps=4, update_seconds=8.0) == 80  # 12 / 4 + 8 / 4 = 5 s, as above
    assert plan(4, 20.0, update_steps=0) is None  # no update timed yet: the next step that updates plans
    assert plan(6, 30.0, update_steps=1, update_seconds=10.0) == 30  # 20 / 6 + 10 = 13.3 s: 6 + 29 -> 30
    assert plan(3, 20.0) is None  # only from the end of the warm-up
    assert plan(5, 20.0, planned=80) == 80  # fixed once
    assert plan(0, 20.0, of=GRPOConfig(max_steps=120, max_train_seconds=450)) is None  # clock
    assert lr_factor(config, 4, 0.0, 80) == lr_factor(config.model_copy(update={"max_steps": 80}), 4)
    assert lr_factor(config, 10, 449.0) == lr_factor(config, 10, 0.0)  # not planned yet: steps, not time
    with pytest.raises(ConfigError, match="max_train_seconds, which is null"):
        GRPOConfig(time_budget="calibrated", warmup_steps=4)
    with pytest.raises(ConfigError, match="warmup_steps=0; set warmup_steps >= 1"):
        GRPOConfig(time_budget="calibrated", max_train_seconds=450)


def test_a_shorter_plan_peaks_higher_up_to_the_cap_and_resumes_at_that_peak(tmp_path, monkeypatch):
    """lr 0.3, lr_reference_steps 30, cap 0.6, a 300 s budget, 2 warm-up steps. At 10 s a step the plan
    is 20 steps (see above): peak 0.3 x 30 / 20 = 0.45; at 20 s it is 14 steps: 0.3 x 30 / 14 = 0.64,
    capped at 0.6. The warm-up climbs to 0.3 either way (it runs before the plan); a resumed run
    continues at its plan's peak."""
    raised = dict(max_train_seconds=300.0, lr_reference_steps=30, max_learning_rate=0.6, save_every_steps=5)
    for speed, steps, peak in ((10.0, 20, 0.45), (20.0, 14, 0.6)):
        trainer = calibrated(tmp_path / str(speed), **raised)
        clocked(trainer, monkeypatch, speed)
        history = trainer.train()
        decay = steps - 2
        want = [0.1, 0.2] + [peak / 2 * (1 + math.cos(math.pi * k / decay)) for k in range(decay)]
        assert trainer.step_count == steps and [m["lr"] for m in history] == pytest.approx(want)
    checkpoint = str(tmp_path / "10.0" / "checkpoint-5")
    resumed = calibrated(tmp_path / "10.0", components={"resume_from": checkpoint}, **raised)
    clocked(resumed, monkeypatch, 10.0)
    rest = [0.225 * (1 + math.cos(math.pi * k / 18)) for k in range(3, 18)]  # steps 6-20 of the 10 s run
    assert [m["lr"] for m in resumed.train()] == pytest.approx(rest)


def test_peak_learning_rate_by_hand_and_its_bad_settings():
    config = GRPOConfig(learning_rate=3e-4, lr_reference_steps=90, max_learning_rate=4e-4, max_steps=100,
                        lr_schedule="cosine", warmup_steps=4, max_train_seconds=480, time_budget="calibrated")
    peaks = [peak_learning_rate(config, steps) for steps in (None, 120, 100, 90, 80, 70, 60, 30)]
    # None and 120: max_steps (100) steps; 80: 3e-4 x 90 / 80; 70: 3.857e-4; 60 and 30: the cap
    assert peaks == pytest.approx([3e-4, 3e-4, 3e-4, 3e-4, 3.375e-4, 3e-4 * 90 / 70, 4e-4, 4e-4], rel=1e-12)
    assert peak_learning_rate(config.model_copy(update={"max_steps": 45})) == pytest.approx(4e-4)
    assert peak_learning_rate(GRPOConfig(learning_rate=3e-4), 10) == 3e-4  # no reference: never raised
    assert lr_factor(config, 3, 0.0, 80) == pytest.approx(0.8)  # the warm-up climbs to learning_rate
    assert lr_factor(config, 4, 0.0, 80) == pytest.approx(3.375 / 3)  # then starts from the raised peak
    assert lr_factor(config, 42, 0.0, 80) == pytest.approx(3.375 / 3 * 0.5)  # half-way through the cosine
    with pytest.raises(ConfigError, match="lr_reference_steps=90 raises .* max_learning_rate is null"):
        GRPOConfig(learning_rate=3e-4, lr_reference_steps=90)
    with pytest.raises(ConfigError, match=r"max_learning_rate=0.0001 is below learning_rate=0.0003"):
        GRPOConfig(learning_rate=3e-4, lr_reference_steps=90, max_learning_rate=1e-4)
    with pytest.raises(ConfigError, match="lr_reference_steps=0 must be >= 1"):
        GRPOConfig(learning_rate=3e-4, lr_reference_steps=0, max_learning_rate=4e-4)
