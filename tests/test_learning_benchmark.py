"""The learning benchmark (benchmarks/learning.py): its training clock, its checks, and a smoke run.

The smoke run is the real harness on a tiny random-init Llama with a character tokenizer saved to a
temporary folder: the parent starts one worker process per engine (ours, then TRL), each trains
for a 3 s budget, and the parent prints the JSON last line and writes the plot and the report.
The tiny model cannot do arithmetic, so its accuracies are 0 and the honesty warning fires; what
is checked is the plumbing: keys, steps, the clock, identical settings and prompt tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import learning  # noqa: E402

# -- the clock ------------------------------------------------------------------------------------


def test_clock_excludes_evaluation_and_checkpoints_on_training_time():
    calls = []
    clock = learning.TrainingClock(budget_s=10.0, eval_every_s=3.0, evaluate=lambda: calls.append(1) or 0.5)
    # steps of 2 s: training time 2, 4, 6, 8, 10. A checkpoint once 3 s have passed (at 4), once 6 s have
    # (at 6); 9 s passes at 10, where the budget is spent: the caller evaluates the final model itself
    for _ in range(5):
        assert not clock.spent
        clock.step_done(2.0)
    assert clock.spent and clock.steps == 5 and clock.train_s == 10.0
    assert [(p["train_s"], p["step"]) for p in clock.curve] == [(4.0, 2), (6.0, 3)]
    assert len(calls) == 2
    summary = clock.summary()
    assert summary["step_s_mean"] == 2.0 and summary["step_s_median"] == 2.0


def test_clock_without_periodic_evaluation():
    clock = learning.TrainingClock(budget_s=1.0, eval_every_s=0, evaluate=lambda: pytest.fail("evaluated"))
    clock.step_done(0.4)
    clock.step_done(0.7)  # overshoots: the budget is checked between steps, as both engines do
    assert clock.spent and clock.curve == [] and clock.train_s == pytest.approx(1.1)


def _run(seed, before, settings, prompt_ids=(1, 2)):
    return {"seed": seed, "before": before, "steps": 3, "settings": settings, "prompt_ids": list(prompt_ids)}


def test_checks_name_every_difference_that_breaks_the_comparison():
    spec = learning.Spec(model="m", mode="identical")
    ours = _run(0, 0.125, {"learning_rate": 1e-4, "temperature": 1.0})
    trl = _run(0, 0.25, {"learning_rate": 1e-6, "temperature": 1.0}, prompt_ids=(1, 3))
    problems, warnings = learning._checks(spec, {"ours": [ours], "trl": [trl]})
    assert problems == ["seed 0: the base model scored 0.125 for ours, 0.25 for trl",
                        "seed 0: the engines render the first training prompt to different tokens",
                        "setting learning_rate: ours 0.0001 != trl 1e-06"]
    assert warnings == []
    # in the defaults mode settings may differ; a base model outside 10-50% is a warning
    spec = learning.Spec(model="m", mode="defaults")
    problems, warnings = learning._checks(spec, {"ours": [_run(0, 0.6, {"a": 1})],
                                                 "trl": [_run(0, 0.6, {"a": 2})]})
    assert problems == [] and len(warnings) == 2 and "0.600" in warnings[0]


# -- the smoke run --------------------------------------------------------------------------------


def test_smoke_run_trains_both_engines_and_reports(tiny_folder, tmp_path, capsys):
    pytest.importorskip("trl")
    out = tmp_path / "out"
    code = learning.main(["--model", str(tiny_folder), "--budget-s", "3", "--eval-every-s", "1",
                          "--num-train", "20", "--num-test", "8", "--eval-subset", "4",
                          "--prompts-per-step", "2", "--group-size", "2", "--max-completion-tokens", "4",
                          "--out", str(out)])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0, last
    assert list(last)[:5] == ["task", "budget_s", "ours", "trl", "delta_after_pts"]
    assert last["budget_s"] == 3.0 and last["problems"] == [] and last["errors"] == []
    for engine in ("ours", "trl"):
        result = last[engine]
        assert {"before", "after", "steps"} <= set(result)
        assert result["steps"] >= 1 and result["train_s"] >= 3.0
        assert 0.0 <= result["before"] <= 1.0 and 0.0 <= result["after"] <= 1.0
    assert last["delta_after_pts"] == pytest.approx(100 * (last["ours"]["after"] - last["trl"]["after"]))
    assert (out / "learning.png").stat().st_size > 0
    report = json.loads((out / "report.json").read_text())
    for engine in ("ours", "trl"):
        run = report["runs"][engine][0]
        curve = run["curve"]  # at 0, every 1 s of training while the budget lasts, and the final model
        assert curve[0]["train_s"] == 0.0 and curve[0]["step"] == 0 and len(curve) >= 2
        assert curve[-1]["train_s"] == run["train_s"] and curve[-1]["step"] == run["steps"]
        assert sum(run["step_s"]) == pytest.approx(run["train_s"])
        # one record per optimizer step: lengths within the limit, truncated fractions of 4 completions
        assert len(run["reward_mean_per_step"]) == len(run["completion_length_per_step"]) == run["steps"]
        assert all(1 <= x <= 4 for x in run["completion_length_per_step"])
        assert [x * 4 for x in run["truncated_fraction_per_step"]] == [
            round(x * 4) for x in run["truncated_fraction_per_step"]]
        assert len(run["truncated_fraction_per_step"]) == run["steps"]
        assert len(run["completions_after"]) == 4
        assert all(isinstance(t, str) for t in run["completions_after"])
    ours, trl = report["runs"]["ours"][0], report["runs"]["trl"][0]
    assert ours["settings"] == trl["settings"]  # identical mode: what each engine holds
    assert last["ours"]["settings"] == ours["settings"] and last["trl"]["settings"] == trl["settings"]
    assert ours["prompt_ids"] == trl["prompt_ids"]
    assert ours["settings"]["completions_per_optimizer_step"] == 4
    assert trl["settings"]["generations_per_optimizer_step"] == 1


DEFAULTS = dict(mode="defaults", budget_s=1e-3, num_train=20, num_test=4, eval_subset=2, eval_every_s=0,
                prompts_per_step=2, group_size=2, max_completion_tokens=4)  # one step each


def test_defaults_mode_trains_ours_with_its_own_batch_shape(tiny_folder, tmp_path):
    """--prompts-per-step / --group-size fix TRL's batch; in the defaults mode ours keeps DemoSettings'."""
    from grpo_engine.demo import DemoSettings

    spec = learning.Spec(model=str(tiny_folder), **DEFAULTS)
    settings = learning.run_ours(spec, str(tmp_path))["settings"]
    demo = DemoSettings()
    assert (settings["prompts_per_step"], settings["group_size"]) == (demo.prompts_per_step, demo.group_size)
    assert settings["max_completion_tokens"] == demo.max_completion_tokens
    assert settings["lr_schedule"] == demo.lr_schedule
    assert settings["aggregation"] == demo.loss_aggregation  # the recipe's loss and advantage
    assert settings["advantage"] == learning._advantage(demo.advantage_std_scope, 1e-6)
    assert settings["weights_dtype"] == settings["compute_dtype"] == "float32"
    assert settings["gradient_checkpointing"] is False


def test_defaults_mode_gives_trl_what_its_users_pick_on_a_cpu(tiny_folder, tmp_path):
    """On the CPU: float32 without autocast, no gradient checkpointing (TRL's defaults turn both on, for a
    GPU), the demo's 16 training tokens like ours; TRL's own lr, loss, betas, schedule and micro-batch
    stay."""
    pytest.importorskip("trl")
    from grpo_engine.demo import DemoSettings

    spec = learning.Spec(model=str(tiny_folder), **DEFAULTS)
    settings = learning.run_trl(spec, str(tmp_path))["settings"]
    assert settings["weights_dtype"] == settings["compute_dtype"] == "float32"  # no bf16 autocast
    assert settings["gradient_checkpointing"] is False
    assert settings["max_completion_tokens"] == DemoSettings().max_completion_tokens == 16
    # --prompts-per-step / --group-size
    assert (settings["prompts_per_step"], settings["group_size"]) == (2, 2)
    assert settings["learning_rate"] == learning.TRL_DEFAULTS_LR and settings["lr_schedule"] == "linear"
    assert settings["aggregation"] == "token" and settings["adam_betas"] == [0.9, 0.999]  # loss_type="dapo"
    assert settings["micro_batch_size"] == 4  # its default 8, reduced to gcd with B*G = 4


def test_first_seed_runs_the_later_seeds_in_the_alternating_order(tmp_path, monkeypatch):
    """--first-seed 2 --seeds 2 runs seeds 2 and 3 only, each in the order a full run gives it."""
    calls = []

    settings = {"prompts_per_step": 2, "group_size": 2, "max_completion_tokens": 16,
                "weights_dtype": "float32", "compute_dtype": "float32",
                "gradient_checkpointing": False, "learning_rate": 1e-4, "lr_schedule": "linear",
                "aggregation": "token", "advantage": "z-score, group std + 0.0001", "micro_batch_size": 4}

    def fake_worker(engine, spec, out):
        calls.append((spec.seed, engine))
        return {"engine": engine, "seed": spec.seed, "before": 0.25,
                "after": 0.5 if engine == "ours" else 0.25, "steps": 3, "step_s_mean": 1.0, "train_s": 3.0,
                "prompt_ids": None, "settings": settings}, None

    monkeypatch.setattr(learning, "_run_worker", fake_worker)
    monkeypatch.setattr(learning, "plot", lambda *args, **kwargs: None)
    spec = learning.Spec(model="unused", mode="defaults", budget_s=1.0, num_train=20, num_test=4,
                         eval_subset=2, eval_every_s=0, prompts_per_step=2, group_size=2,
                         max_completion_tokens=4)
    summary = learning.compare(spec, 2, tmp_path, first_seed=2)
    assert calls == [(2, "ours"), (2, "trl"), (3, "trl"), (3, "ours")]
    assert summary["ours"]["seeds"] == [2, 3] and summary["first_seed"] == 2 and summary["seeds"] == 2
    assert summary["delta_after_pts_runs"] == [25.0, 25.0]
    assert summary["ours"]["settings"] == summary["trl"]["settings"] == settings
    table = learning._table(summary)
    assert "mode defaults (each engine's recommended settings for this hardware)" in table
    assert "2 seed(s) from seed 2" in table
    assert ("trl used: 2 prompts x 2 completions, 16 completion tokens, float32, no gradient checkpointing, "
            "lr 0.0001 linear, token loss aggregation, advantage z-score, group std + 0.0001, "
            "micro-batch 4") in table
    report = json.loads((tmp_path / "report.json").read_text())  # rewritten after each worker: here the last
    assert [r["seed"] for r in report["runs"]["trl"]] == [2, 3] and report["errors"] == []


def test_bad_first_seed_is_refused_with_the_rule(capsys):
    with pytest.raises(SystemExit):
        learning.main(["--first-seed", "-1", "--model", "unused"])
    err = capsys.readouterr().err
    assert "--first-seed -1" in err and "--first-seed >= 0" in err


def test_clock_with_equal_steps_ignores_the_budget_and_evaluates_every_k_steps():
    calls = []
    clock = learning.TrainingClock(budget_s=1.0, eval_every_s=0.5, evaluate=lambda: calls.append(1) or 0.5,
                                   max_steps=5, eval_every_steps=2)
    for _ in range(5):  # 3 s of steps against a 1 s budget: the step count alone decides
        assert not clock.spent
        clock.step_done(0.6)
    assert clock.spent and clock.steps == 5
    # points after steps 2 and 4 (not by time); after step 5 the caller evaluates the final model itself
    assert [p["step"] for p in clock.curve] == [2, 4] and len(calls) == 2
    # --eval-every-steps 0: no point between the first and the last, and none by time either
    clock = learning.TrainingClock(budget_s=1.0, eval_every_s=0.5, evaluate=lambda: pytest.fail("evaluated"),
                                   max_steps=3, eval_every_steps=0)
    for _ in range(3):
        clock.step_done(0.6)
    assert clock.spent and clock.curve == []


def test_equal_steps_run_trains_ours_exactly_that_many_steps(tiny_folder, tmp_path):
    spec = learning.Spec(model=str(tiny_folder), budget_s=1e-3, steps=3, eval_every_steps=2, num_train=20,
                         num_test=4, eval_subset=2, prompts_per_step=2, group_size=2, max_completion_tokens=4)
    result = learning.run_ours(spec, str(tmp_path))
    assert result["steps"] == 3 and len(result["reward_mean_per_step"]) == 3
    assert [p["step"] for p in result["curve"]] == [0, 2, 3]  # the start, every 2 steps, the end
    problems, _ = learning._checks(spec, {"ours": [{**result, "steps": 2, "seed": 0}], "trl": []})
    assert problems == ["ours seed 0: 2 steps, not --steps 3"]
    summary = {"task": "t", "mode": "identical", "budget_s": None, "steps": 3, "seeds": 1, "first_seed": 0,
               "ours": None, "trl": None, "delta_after_pts": None, "problems": [], "warnings": [],
               "errors": [], "out": "o"}
    assert "budget 3 steps of training" in learning._table(summary)


def test_bad_steps_are_refused_with_the_rule(capsys):
    with pytest.raises(SystemExit):
        learning.main(["--steps", "0", "--model", "unused"])
    err = capsys.readouterr().err
    assert "--steps 0" in err and "--steps >= 1" in err


def test_a_reasoning_gym_task_is_the_demos_and_trl_scores_each_completion_by_its_own_prompt(tiny_folder):
    pytest.importorskip("reasoning_gym")
    from grpo_engine.demo import DemoSettings, demo_reward, demo_task, demo_template

    spec = learning.Spec(model=str(tiny_folder), task="rg:gcd", task_config={"max_value": 30}, num_train=6,
                         num_test=3, task_seed=2)
    s = learning._setup(spec)
    demo = DemoSettings(task="gcd", task_config={"max_value": 30}, num_train=6, num_test=3, seed=2)
    assert (s.train, s.test) == demo_task(demo)  # the demo's prompts, template and scorer
    assert s.template == demo_template(demo) and s.reward.extract == demo_reward(demo).extract == "final"
    assert not {p.question for p in s.train} & {p.question for p in s.test}
    rows = learning.trl_rows(s)
    assert [r["index"] for r in rows] == list(range(6))
    assert rows[0]["prompt"] == s.template.messages(s.train[0])
    reward = learning.trl_reward(s)
    i, j = next((i, j) for i in range(6) for j in range(6) if s.train[i].target != s.train[j].target)
    answers = [f"It is {s.train[i].target}.", f"It is {s.train[j].target}."]
    assert reward(answers, index=[i, j]) == [1.0, 1.0]
    swapped = reward(answers, index=[j, i])  # another prompt's answer: under 1 (gcd's partial credit)
    assert all(x < 1.0 for x in swapped)
    assert swapped == [s.reward([s.train[j]], answers[:1]).item(), s.reward([s.train[i]], answers[1:]).item()]
    assert "reasoning_gym_task('gcd', config={\"max_value\": 30}" in learning._task_name(spec)


def test_a_bad_task_is_refused_with_the_rule(capsys):
    for argv in (["--task", "gcd"], ["--task-config", '{"max_value": 3}'],
                 ["--task", "rg:gcd", "--task-config", "[3]"]):
        with pytest.raises(SystemExit):
            learning.main([*argv, "--model", "unused"])
        assert "--task is arithmetic or rg:FAMILY, and --task-config a JSON object" in capsys.readouterr().err
