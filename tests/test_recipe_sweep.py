"""benchmarks/recipe_sweep.py on a tiny local model: the curve's steps, the variants applied, bad fields."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import recipe_sweep  # noqa: E402


def test_each_variant_gets_a_curve_at_the_eval_steps(tiny_folder, capsys, monkeypatch):
    seen = []
    real = recipe_sweep.run_variant

    def spy(variant, **kwargs):
        seen.append(variant)
        return real(variant, **kwargs)

    monkeypatch.setattr(recipe_sweep, "run_variant", spy)
    small = {"num_train": 16, "num_test": 4, "max_completion_tokens": 4, "eval_max_new_tokens": 4}
    variants = [small, {**small, "temperature": 0.8, "lr_schedule": "linear"}]
    assert recipe_sweep.main(["--model", str(tiny_folder), "--steps", "3", "--eval-every", "2",
                              *[a for v in variants for a in ("--variant", json.dumps(v))]]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert seen == variants
    assert list(result) == [json.dumps(v, sort_keys=True) for v in variants]
    for entry in result.values():
        assert [step for step, *_ in entry["curve"]] == [2, 3]  # every 2 steps, and the last
        assert all(0.0 <= acc <= 1.0 for _, acc, *_ in entry["curve"]) and entry["step_s"] > 0
        assert all(acc == demo for _, acc, demo, _ in entry["curve"])  # the whole set is the demo's split
        assert all(sum(total for _, total in kinds.values()) == 4 for *_, kinds in entry["curve"])


def test_a_larger_held_out_set_starts_with_the_demo_split(tiny_folder, monkeypatch):
    """--eval-problems 6 scores 6 problems; the demo-split figure counts only the first num_test (4) of
    them."""
    import grpo_engine.eval

    calls = []

    def fake(model, tokenizer, prompts, reward, **kwargs):
        calls.append([p.content for p in prompts])
        return grpo_engine.eval.EvalResult(accuracy=0.0, completions=("",) * len(prompts),
                                           scores=tuple(1.0 if i % 2 else 0.0 for i in range(len(prompts))))

    monkeypatch.setattr(grpo_engine.eval, "greedy_accuracy", fake)
    small = {"num_train": 16, "num_test": 4, "max_completion_tokens": 4, "eval_max_new_tokens": 4}
    result = recipe_sweep.run_variant({**small, "config": {"warmup_steps": 1}}, steps=1, eval_every=1,
                                      model=str(tiny_folder), threads=1, eval_problems=6)
    from grpo_engine.data import arithmetic_task

    demo_test = [p.content for p in arithmetic_task(16, 4, seed=0)[1]]
    assert calls == [[p.content for p in arithmetic_task(16, 6, seed=0)[1]]] and calls[0][:4] == demo_test
    assert result["curve"][0][:3] == [1, 3 / 6, 2 / 4]
    expected = recipe_sweep.accuracy_by_kind(arithmetic_task(16, 6, seed=0)[1],
                                             [bool(i % 2) for i in range(6)])
    assert result["curve"][0][3] == expected


def test_accuracy_by_kind_splits_subtraction_by_the_sign_of_its_result():
    from grpo_engine.types import Prompt

    problems = [Prompt("What is 12 + 30?", target="42", metadata={"op": "+"}),
                Prompt("What is 30 - 12?", target="18", metadata={"op": "-"}),
                Prompt("What is 12 - 30?", target="-18", metadata={"op": "-"}),
                Prompt("What is 40 - 40?", target="0", metadata={"op": "-"}),
                Prompt("What is 11 + 11?", target="22", metadata={"op": "+"})]
    assert recipe_sweep.accuracy_by_kind(problems, [True, False, True, True, False]) == {
        "+": [1, 2], "- (result < 0)": [1, 1], "- (result >= 0)": [1, 2]}


def test_a_short_sweep_peaks_where_the_demo_would_for_that_plan(tiny_folder, monkeypatch):
    """3 steps with 1 warm-up step: the demo's peak is 3e-4 at any plan, so the lr is 1.5e-4 (warm-up),
    3e-4, then 1.5e-4 half-way down the cosine; a variant with lr_reference_steps 80 and a cap of 4e-4
    peaks at min(3e-4 x 80 / 3, 4e-4) = 4e-4."""
    import grpo_engine

    built = []
    real = grpo_engine.GRPOTrainer

    def spy(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(grpo_engine, "GRPOTrainer", spy)
    small = {"num_train": 16, "num_test": 4, "max_completion_tokens": 4, "eval_max_new_tokens": 4,
             "config": {"warmup_steps": 1}}
    recipe_sweep.run_variant(small, steps=3, eval_every=3, model=str(tiny_folder), threads=1)
    recipe_sweep.run_variant({**small, "lr_reference_steps": 80, "max_learning_rate": 4e-4}, steps=3,
                             eval_every=3, model=str(tiny_folder), threads=1)
    assert [m["lr"] for m in built[0].history] == pytest.approx([1.5e-4, 3e-4, 1.5e-4])
    assert [m["lr"] for m in built[1].history] == pytest.approx([1.5e-4, 4e-4, 2e-4])


def test_lora_r_zero_trains_every_weight(tiny_folder, monkeypatch):
    import grpo_engine

    built = []
    real = grpo_engine.GRPOTrainer

    def spy(*args, **kwargs):
        built.append(kwargs["memory"])
        return real(*args, **kwargs)

    monkeypatch.setattr(grpo_engine, "GRPOTrainer", spy)
    small = {"num_train": 16, "num_test": 4, "max_completion_tokens": 4, "eval_max_new_tokens": 4}
    recipe_sweep.run_variant({**small, "lora_r": 0}, steps=1, eval_every=1, model=str(tiny_folder), threads=1)
    assert built[0].lora is None


def test_a_dynamic_sampling_variant_builds_the_filter(tiny_folder, monkeypatch):
    import grpo_engine
    from grpo_engine.sampling import DynamicSampling

    built = []
    real = grpo_engine.GRPOTrainer

    def spy(*args, **kwargs):
        built.append(kwargs.get("sampler"))
        return real(*args, **kwargs)

    monkeypatch.setattr(grpo_engine, "GRPOTrainer", spy)
    small = {"num_train": 16, "num_test": 4, "max_completion_tokens": 4, "eval_max_new_tokens": 4}
    recipe_sweep.run_variant({**small, "dynamic_sampling": {"max_rounds": 2}}, steps=1, eval_every=1,
                             model=str(tiny_folder), threads=1)
    recipe_sweep.run_variant(small, steps=1, eval_every=1, model=str(tiny_folder), threads=1)
    assert built == [DynamicSampling(max_rounds=2), None]


def test_advantage_and_loss_variants_build_those_components(tiny_folder, monkeypatch):
    import grpo_engine
    from grpo_engine.advantages import RLOO, GroupNormalized
    from grpo_engine.demo import DemoSettings, recipe_components
    from grpo_engine.losses import ClippedSurrogate

    built = []
    real = grpo_engine.GRPOTrainer

    def spy(*args, **kwargs):
        built.append((kwargs.get("advantage"), kwargs.get("loss")))
        return real(*args, **kwargs)

    monkeypatch.setattr(grpo_engine, "GRPOTrainer", spy)
    small = {"num_train": 16, "num_test": 4, "max_completion_tokens": 4, "eval_max_new_tokens": 4}
    recipe_sweep.run_variant({**small, "advantage": {"name": "GroupNormalized", "std_scope": "none"},
                              "loss": {"aggregation": "constant", "max_completion_tokens": 4}},
                             steps=1, eval_every=1, model=str(tiny_folder), threads=1)
    recipe_sweep.run_variant({**small, "advantage": {"name": "RLOO"}}, steps=1, eval_every=1,
                             model=str(tiny_folder), threads=1)
    dr_grpo_loss = ClippedSurrogate(aggregation="constant", max_completion_tokens=4)
    recipe_loss = recipe_components(DemoSettings(**small))["loss"]
    assert built == [(GroupNormalized(std_scope="none"), dr_grpo_loss), (RLOO(), recipe_loss)]


@pytest.mark.parametrize("name", ["GroupNormalised", "zero_std_fraction", None])
def test_an_advantage_that_is_not_a_class_of_the_module_is_refused(name):
    with pytest.raises(ValueError, match=f"advantage name {name!r}.*GroupNormalized"):
        recipe_sweep.build_advantage({"name": name} if name else {})


def test_a_loss_named_in_a_variant_is_built_and_its_metrics_reported(tiny_folder):
    """``{"name": "SAPO"}`` builds that loss of grpo_engine.losses; the result holds the mean of each metric
    the loss logged over the last steps (SAPO's gate damping; with a KL term, so that the tiny model's tied
    groups still train), and an unknown name lists the losses."""
    from grpo_engine.losses import SAPO

    assert recipe_sweep.build_loss({"name": "SAPO", "temperature_neg": 2.0}) == SAPO(temperature_neg=2.0)
    small = {"num_train": 16, "num_test": 4, "max_completion_tokens": 4, "eval_max_new_tokens": 4}
    result = recipe_sweep.run_variant({**small, "loss": {"name": "SAPO", "kl_coef": 0.1}}, steps=2,
                                      eval_every=2, model=str(tiny_folder), threads=1)
    metrics = result["loss_metrics"]
    assert {"gate_damping", "kl", "policy_loss"} <= set(metrics) and "loss" not in metrics
    assert 0.0 <= metrics["gate_damping"] <= 1.0 and metrics["kl"] >= 0.0
    with pytest.raises(ValueError, match=r"loss name 'SAPOO' is not a loss .*'ClippedSurrogate', 'GSPO'"):
        recipe_sweep.build_loss({"name": "SAPOO"})


def test_an_unknown_recipe_field_is_refused(tiny_folder):
    with pytest.raises(TypeError, match="temprature"):
        recipe_sweep.run_variant({"temprature": 0.8}, steps=1, eval_every=1, model=str(tiny_folder),
                                 threads=1)
