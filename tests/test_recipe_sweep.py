"""benchmarks/recipe_sweep.py on a tiny local model: the curve's steps, the variants applied, bad fields."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import recipe_sweep  # noqa: E402
from tests.tiny import char_tokenizer, tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-model")
    tokenizer = char_tokenizer()
    tiny_llama(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


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
        assert [step for step, _ in entry["curve"]] == [2, 3]  # every 2 steps, and the last
        assert all(0.0 <= acc <= 1.0 for _, acc in entry["curve"]) and entry["step_s"] > 0


def test_an_unknown_recipe_field_is_refused(tiny_folder):
    with pytest.raises(TypeError, match="temprature"):
        recipe_sweep.run_variant({"temprature": 0.8}, steps=1, eval_every=1, model=str(tiny_folder), threads=1)
