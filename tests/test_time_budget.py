"""A calibrated time budget: the warm-up steps are timed, the run's step count is fixed from them, and the
schedule follows steps, so the same seed gives the same run on machines of slightly different speed,
and a slower machine runs fewer steps inside the same budget."""

from __future__ import annotations

import math

import pytest

from grpo_engine import GRPOConfig
from grpo_engine.config import ConfigError, lr_factor, planned_steps
from tests.test_trainer import make_trainer


def clocked(trainer, monkeypatch, seconds_per_sample: float) -> list[float]:
    """A fake clock that moves ``seconds_per_sample`` whenever the trainer samples, and not otherwise."""
    import grpo_engine.logging as logging_module

    now = [100.0]
    monkeypatch.setattr(logging_module.time, "perf_counter", lambda: now[0])
    sample = trainer.sampler.sample

    def slow_sample(*args, **kwargs):
        now[0] += seconds_per_sample
        return sample(*args, **kwargs)

    trainer.sampler.sample = slow_sample
    return now


def calibrated(tmp_path, **changes):
    settings = dict(lr_schedule="cosine", max_steps=1000, max_train_seconds=100.0, warmup_steps=2,
                    time_budget="calibrated", learning_rate=0.3, output_dir=str(tmp_path))
    return make_trainer(tmp_path, **{**settings, **changes})


def test_the_warm_up_fixes_the_steps_and_the_schedule_follows_them(tmp_path, monkeypatch):
    """10 s a step: after 2 warm-up steps (20 s), 0.9 x 80 s fit 7 more steps, so 9 in all (below 20
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
    # 10 s: 2 + int(0.9 x 280 / 10) = 27 -> 20; 10.4 s: 2 + 24 = 26 -> 20; 20 s: 2 + int(0.9 x 260 / 20) = 13
    assert len(runs[10.0]) == len(runs[10.4]) == 20 and len(runs[20.0]) == 13
    assert runs[10.0] == runs[10.4]  # every metric of every step, exactly


def test_a_calibrated_run_resumes_with_its_planned_steps(tmp_path, monkeypatch):
    trainer = calibrated(tmp_path, save_every_steps=3)
    clocked(trainer, monkeypatch, 10.0)
    trainer.train()
    resumed = calibrated(tmp_path, save_every_steps=3,
                         components={"resume_from": str(tmp_path / "checkpoint-6")})
    assert resumed.state.planned_steps == 9 and resumed.step_count == 6


def test_planned_steps_rounds_down_to_tens_and_needs_a_budget_and_a_warm_up():
    config = GRPOConfig(max_steps=120, max_train_seconds=450, warmup_steps=4, time_budget="calibrated")
    assert planned_steps(config, 4, 12.0, None) == 120  # 4 + int(0.9 x 438 / 3) = 135 > 120: max_steps
    assert planned_steps(config, 4, 20.0, None) == 80  # 4 + int(0.9 x 430 / 5) = 81 -> 80
    assert planned_steps(config, 3, 20.0, None) is None  # only at the end of the warm-up
    assert planned_steps(config, 5, 20.0, 80) == 80  # fixed once
    assert planned_steps(GRPOConfig(max_steps=120, max_train_seconds=450), 0, 20.0, None) is None  # clock
    assert lr_factor(config, 4, 0.0, 80) == lr_factor(config.model_copy(update={"max_steps": 80}), 4)
    with pytest.raises(ConfigError, match="max_train_seconds, which is null"):
        GRPOConfig(time_budget="calibrated", warmup_steps=4)
    with pytest.raises(ConfigError, match="warmup_steps=0; set warmup_steps >= 1"):
        GRPOConfig(time_budget="calibrated", max_train_seconds=450)
