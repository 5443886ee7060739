"""Smoke test of the benchmark harness (benchmarks/perf.py) on its micro preset, plus its helpers.

The harness runs as a user runs it: a parent process that starts one worker process per engine
and prints a JSON object as its last line. With TRL installed both engines run and must report
identical settings and full-length completions; without it only our half runs.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PERF = ROOT / "benchmarks" / "perf.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import _models  # noqa: E402

HAS_TRL = importlib.util.find_spec("trl") is not None


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """Runs the micro preset once (both engines when TRL is installed); returns (last line, --out file)."""
    out = tmp_path_factory.mktemp("perf") / "micro.json"
    engines = "ours,trl" if HAS_TRL else "ours"
    proc = subprocess.run(
        [sys.executable, str(PERF), "--preset", "micro", "--engines", engines, "--out", str(out)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), json.loads(out.read_text())


def _check_engine(result: dict, completion_tokens: int) -> None:
    for key in ("step_s", "peak_mib", "tokens_per_s"):
        assert result[key] > 0, key
    # every completion ran to the limit: EOS is outside the model's vocabulary
    assert result["completion_tokens"] == [completion_tokens, completion_tokens]
    stages = result["stages"]
    assert set(stages) == {"generation_s", "reward_s", "logprobs_s", "loss_backward_s", "optimizer_s", "other_s"}
    assert sum(stages.values()) == pytest.approx(result["step_s"], rel=1e-6)
    assert stages["generation_s"] > 0 and stages["loss_backward_s"] > 0 and stages["optimizer_s"] > 0
    assert stages["logprobs_s"] < 0.01 * result["step_s"]  # mu = 1, no KL: no no-grad log-prob pass runs
    assert result["tokens_per_s"] == pytest.approx(result["e2e_tokens_per_s"] * result["step_s"]
                                                   / stages["generation_s"])


def test_our_half_reports_the_required_keys(report):
    last, full = report
    for key in ("preset", "device", "ours", "trl", "ratio_step_time", "ratio_peak_memory"):
        assert key in last, key
    assert last["preset"] == "micro" and last["device"] == "cpu"
    spec = last["spec"]
    _check_engine(last["ours"], spec["completion_tokens"])
    assert last["ours"]["settings"]["prompts_per_step"] == spec["prompts_per_step"]
    # one worker per repetition, each with warm-up + measured steps
    assert len(full["runs"]["ours"]) == spec["repetitions"]
    assert len(full["runs"]["ours"][0]["steps"]) == spec["warmup_steps"] + spec["measured_steps"]


def test_trl_half_ran_with_the_same_settings(report):
    pytest.importorskip("trl")
    last, _ = report
    ours, trl = last["ours"], last["trl"]
    _check_engine(trl, last["spec"]["completion_tokens"])
    assert last["settings_match"] is True and last["problems"] == [] and last["errors"] == []
    assert ours["settings"] == trl["settings"]
    assert ours["trainable_params"] == trl["trainable_params"]
    assert trl["settings"]["completions_per_optimizer_step"] == (
        trl["settings"]["prompts_per_step"] * trl["settings"]["group_size"])
    assert trl["settings"]["generations_per_optimizer_step"] == 1
    assert last["ratio_step_time"] == pytest.approx(ours["step_s"] / trl["step_s"])
    assert last["ratio_peak_memory"] == pytest.approx(ours["peak_mib"] / trl["peak_mib"])


@pytest.mark.parametrize("shape", ["micro", "qwen2-logits"])
def test_count_params_matches_the_built_model(shape):
    model = _models.build_model(shape)
    assert sum(p.numel() for p in model.parameters()) == _models.count_params(shape)["total"]


def test_published_qwen_sizes():
    """Qwen2.5-0.5B has 494.0M parameters and Qwen2.5-1.5B 1,543.7M (tied embeddings)."""
    assert _models.count_params("qwen2.5-0.5b")["total"] == 494_032_768
    assert _models.count_params("qwen2.5-1.5b")["total"] == 1_543_714_304


def test_tokenizer_decodes_every_id_and_eos_is_unreachable():
    vocab = 64
    tok = _models.word_tokenizer(vocab)
    assert tok.eos_token_id == vocab  # outside the model's logits, so it can never be sampled
    words = tok.decode(list(range(2, vocab))).split()
    assert words == [f"t{i}" for i in range(2, vocab)]
    prompt = _models.make_prompts(1, 7, vocab)[0]
    assert len(tok(prompt)["input_ids"]) == 7
    model = _models.build_model(_models.ModelShape("llama", 16, 1, 2, 1, 32, vocab, False, 64))
    assert model.generation_config.eos_token_id == vocab
    out = model.generate(input_ids=torch.tensor([[5, 6]]), max_new_tokens=12, do_sample=True)
    assert out.shape == (1, 14)


def test_hash_score_is_deterministic_and_spread():
    scores = [_models.hash_score(f"t{i} t{i + 1}") for i in range(50)]
    assert scores == [_models.hash_score(f"t{i} t{i + 1}") for i in range(50)]
    assert all(0 <= s < 1 for s in scores) and len(set(scores)) > 40
