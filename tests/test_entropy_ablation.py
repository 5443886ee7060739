"""The entropy ablation (benchmarks/entropy_ablation.py): each arm installs its component, the summary.

The arms are built on a tiny random-init Llama with a character tokenizer and trained one step in
this process; the end-to-end run starts real worker processes on the same tiny model saved to a
folder. The tiny model cannot do arithmetic (accuracy 0); what is checked is the plumbing.
"""

from __future__ import annotations

import json
import statistics
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import entropy_ablation as ablation  # noqa: E402

from grpo_engine import ClippedSurrogate, GroupNormalized  # noqa: E402
from grpo_engine.advantages import EntropyScaled  # noqa: E402
from grpo_engine.data import ChatTemplate, InformativeCurriculum, PromptStream, arithmetic_task  # noqa: E402
from grpo_engine.entropy import AdaptiveTemperature, SemanticEntropy  # noqa: E402
from grpo_engine.rewards import MathAccuracy  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices gain nothing from threads, and on a loaded CPU extra threads spin-wait."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SMALL = dict(num_train=20, num_test=4, prompts_per_step=2, group_size=4, max_completion_tokens=4,
             eval_max_new_tokens=4, micro_batch_size=8)


@pytest.mark.parametrize("arm", list(ablation.ARMS))
def test_each_arm_installs_its_component_and_only_it(arm, tmp_path):
    from tests.tiny import char_tokenizer, tiny_llama

    tokenizer = char_tokenizer()
    spec = ablation.Spec(model="unused", arm=arm, seed=3, steps=1, **SMALL)
    train, _ = arithmetic_task(spec.num_train, spec.num_test, seed=spec.task_seed)
    trainer = ablation.build_trainer(spec, tiny_llama(len(tokenizer)), tokenizer, train,
                                     ChatTemplate(instruction=spec.instruction), MathAccuracy(),
                                     str(tmp_path))
    assert trainer.config.seed == 3 and trainer.config.max_steps == 1
    assert trainer.advantage == (EntropyScaled() if arm == "entropy_scaled" else GroupNormalized())
    expected_loss = (ClippedSurrogate(top_entropy_quantile=0.2) if arm == "top_entropy_tokens"
                     else ClippedSurrogate())
    assert trainer.loss == expected_loss
    controls = [c for c in trainer.callbacks if isinstance(c, AdaptiveTemperature)]
    assert len(controls) == (arm == "adaptive_temperature")
    assert isinstance(trainer.prompts, InformativeCurriculum if arm == "curriculum" else PromptStream)
    assert trainer.entropy.estimator == SemanticEntropy(normalize=True)  # every arm logs it; only some use it

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tiny model gets every answer wrong: zero-advantage warning
        metrics = trainer.step()
    observed = trainer.entropy.take()
    assert 0.0 <= observed["semantic_entropy"] <= 1.0
    assert observed["semantic_entropy"] == pytest.approx(metrics["entropy/semantic_mean"])
    # once per step: the advantages, the controller and the curriculum share it
    assert observed["se_calls"] == 1
    assert trainer.entropy.take()["se_calls"] == 0  # take() resets
    if arm == "top_entropy_tokens":  # trains the top 20% of tokens, even in groups with advantage 0
        assert 0.0 < metrics["high_entropy_fraction"] < 0.5
    else:
        assert "high_entropy_fraction" not in metrics
    if arm == "curriculum":
        assert sum(trainer.prompts.stats(p).visits for p in train) == spec.prompts_per_step
    if arm == "adaptive_temperature":
        control = controls[0]
        assert metrics["temperature"] == spec.temperature  # the first step samples at the demo's temperature
        assert trainer.temperature == control.temperature
        assert control.min_temperature <= control.temperature <= control.max_temperature
    else:
        assert trainer.temperature == spec.temperature


def _run(arm, seed, before, after, step_s, rewards=(0.25, 0.5)):
    return {"arm": arm, "seed": seed, "before": before, "after": after, "steps": len(step_s),
            "train_s": sum(step_s), "wall_s": 10.0,
            "curves": {"step_s": list(step_s), "reward": list(rewards)}}


def test_summary_is_the_mean_over_seeds_and_checks_catch_a_broken_comparison():
    runs = [_run("baseline", 1, 0.125, 0.25, [2.0, 4.0]), _run("baseline", 0, 0.125, 0.5, [3.0, 9.0]),
            _run("curriculum", 0, 0.125, 0.375, [1.0, 1.0], rewards=(0.0, 0.0))]
    summary = ablation.summarize(runs)
    base = summary["baseline"]
    assert base["after_per_seed"] == [0.5, 0.25] and base["seeds"] == [0, 1]  # in seed order
    assert base["after_mean"] == statistics.fmean(base["after_per_seed"]) == 0.375
    assert base["after_std"] == pytest.approx(0.25 / 2**0.5)  # sample std of two values: |a - b| / sqrt(2)
    assert base["step_s"] == 3.5  # the median over every step of every seed
    assert summary["curriculum"]["after_std"] is None and summary["curriculum"]["after_mean"] == 0.375
    # the curriculum's own prompt order may differ at step 1
    assert ablation.checks(runs, steps=2) == ([], [])
    broken = runs + [{**_run("entropy_scaled", 0, 0.140625, 0.5, [1.0], rewards=(0.75,)), "code": "abc"}]
    problems, warnings_ = ablation.checks(broken, steps=2)
    assert len(problems) == 3 and problems[0].startswith("the workers imported different grpo_engine sources")
    assert problems[1:] == ["the base model scored differently across workers: [0.125, 0.140625]",
                            "entropy_scaled seed 0: 1 steps, not 2"]
    assert len(warnings_) == 1 and warnings_[0].startswith("seed 0: first-step rewards differ")


def test_end_to_end_in_worker_processes(tmp_path, capsys):
    from tests.tiny import char_tokenizer, tiny_llama

    folder = tmp_path / "tiny"
    tokenizer = char_tokenizer()
    tiny_llama(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "out"
    code = ablation.main(["--model", str(folder), "--arms", "baseline", "top_entropy_tokens", "--seeds", "0",
                          "--steps", "1", "--out", str(out)])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    assert list(last) == ["baseline", "top_entropy_tokens"]
    for summary in last.values():
        assert list(summary) == ["before", "after_mean", "after_std", "after_per_seed", "step_s"]
        assert summary["after_mean"] == summary["after_per_seed"][0] and summary["after_std"] is None
        assert summary["step_s"] > 0
    report = json.loads((out / "ablation.json").read_text())
    assert report["problems"] == [] and report["errors"] == [] and report["warnings"] == []
    assert report["code"] == [ablation.source_hash()]  # both workers ran the code of this tree
    for run in report["runs"]:
        assert run["steps"] == 1 and run["spec"]["task_seed"] == 0 and run["spec"]["threads"] == 1
        assert (len(run["curves"]["reward"]) == len(run["curves"]["semantic_entropy"]) == len(run["history"])
                == 1)
    assert (out / "reward_curves.png").stat().st_size > 0
    for name in ("baseline-seed0", "top_entropy_tokens-seed0"):  # each worker's result and log
        assert json.loads((out / f"{name}.json").read_text()) in report["runs"]
        assert f"[{name.replace('-seed', ' seed ')}] after" in (out / f"{name}.log").read_text()
