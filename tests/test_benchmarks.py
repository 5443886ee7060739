"""Smoke test of benchmarks/perf.py on its micro preset, its model helpers, and the shared harness
(benchmarks/_harness.py: workers, their order, time limits, reports, summaries).

The harness runs as a user runs it: a parent process that starts one worker process per engine
and prints a JSON object as its last line. With TRL installed both engines run and must report
identical settings and full-length completions; without it only our half runs.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PERF = ROOT / "benchmarks" / "perf.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import _harness  # noqa: E402
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
    assert set(stages) == {"generation_s", "reward_s", "logprobs_s", "loss_backward_s", "optimizer_s",
                           "other_s"}
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


# -- the harness every benchmark script shares (benchmarks/_harness.py) ------------------------------------


def test_run_worker_reads_the_tagged_line_and_logs_the_rest(tmp_path):
    """The result is the last tagged stdout line; stderr and the other stdout lines go to the log."""
    log = tmp_path / "run.log"
    code = ("import os, sys; print('a progress line'); print('BENCHMARK_RESULT {\"x\": 1}'); "
            "print('BENCHMARK_RESULT {\"x\": 2, \"launched\": ' "
            "+ os.environ['BENCHMARK_LAUNCHED_AT'] + '}'); "
            "print('a warning', file=sys.stderr)")
    result, error = _harness.run_worker("ours", ["-c", code], timeout=60, log=log)
    assert error is None and result["x"] == 2 and result["launched"] > 0
    text = log.read_text()
    assert text.startswith("--- ours\na warning\n") and "--- ours: stdout\na progress line\n" in text
    assert text.endswith("--- ours: exit 0\n") and "BENCHMARK_RESULT" not in text
    _harness.run_worker("trl", ["-c", "pass"], timeout=60, log=log)  # a second worker appends
    assert log.read_text().startswith(text) and log.read_text().endswith("--- trl: exit 0\n")


def test_run_worker_reports_a_failure_with_its_exit_status_and_output_tail(tmp_path):
    code = "import sys; print('x' * 5000, file=sys.stderr); print('boom', file=sys.stderr); sys.exit(3)"
    # no log: the output is kept for the error
    result, error = _harness.run_worker("trl", ["-c", code], timeout=60)
    assert result is None
    head, tail = error.split("\n", 1)
    assert head == "trl: worker failed (exit 3):"
    assert tail.endswith("boom\n--- trl: exit 3\n") and len(tail) == _harness.TAIL_CHARS
    log = tmp_path / "w.log"
    _, error = _harness.run_worker("w", ["-c", "import sys; sys.exit(1)"], timeout=60, log=log)
    assert error.startswith(f"w: worker failed (exit 1, log: {log}):\n")


def test_run_worker_stops_a_worker_at_its_time_limit(tmp_path):
    log = tmp_path / "run.log"
    result, error = _harness.run_worker("ours", ["-c", "import time; print('started', flush=True); "
                                                       "time.sleep(60)"], timeout=2, log=log)
    assert result is None and error == f"ours: worker timed out after 2 s (log: {log})"
    assert log.read_text().endswith("--- ours: stdout\nstarted\n--- ours: killed: timed out\n")


def test_run_worker_keeps_the_partial_result_of_a_worker_killed_or_failing(tmp_path):
    steps = "; ".join(f"print('BENCHMARK_PARTIAL {{\"steps\": {k}}}', flush=True)" for k in (1, 2))
    result, error = _harness.run_worker("ours", ["-c", f"import time; {steps}; time.sleep(60)"], timeout=3)
    assert result == {"steps": 2, "partial": True} and error == "ours: worker timed out after 3 s"
    result, error = _harness.run_worker("trl", ["-c", f"{steps}; raise SystemExit(3)"], timeout=60)
    assert result == {"steps": 2, "partial": True} and error.startswith("trl: worker failed (exit 3")
    # a finished worker's result wins over its partial lines
    done = f"{steps}; print('BENCHMARK_RESULT {{\"steps\": 3}}')"
    assert _harness.run_worker("ours", ["-c", done], timeout=60) == ({"steps": 3}, None)


@pytest.mark.parametrize("engine", ["ours", "trl"])
def test_a_perf_worker_cut_at_its_limit_keeps_the_steps_it_measured(engine):
    # the micro preset asked for 10,000 steps, cut after 25 s: the report holds the steps measured so far
    if engine == "trl":
        pytest.importorskip("trl")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import perf

    spec = dataclasses.replace(perf.PRESETS["micro"], measured_steps=10_000)
    args = [str(PERF), "--worker", engine, "--spec", json.dumps(dataclasses.asdict(spec))]
    result, error = _harness.run_worker(engine, args, timeout=25 if engine == "ours" else 40)
    assert error is not None and "timed out" in error
    assert result["partial"] is True and result["measured_steps"] >= 1
    assert len(result["steps"]) == result["measured_steps"] + spec.warmup_steps
    assert result["step_s"] > 0 and result["peak_mib"] > 0 and result["settings"]["group_size"] == 2


def test_worker_env_is_offline_and_finds_the_repository():
    env = _harness.worker_env(OMP_NUM_THREADS="1")
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == env["HF_DATASETS_OFFLINE"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT) and env["OMP_NUM_THREADS"] == "1"


def test_schedule_alternates_and_rotates():
    """perf: ours, trl, ours, trl; learning: ours trl, trl ours (by seed); the ablation: arm k first in
    round k."""
    assert _harness.schedule(("ours", "trl"), range(2), rotate=False) == [
        (0, "ours"), (0, "trl"), (1, "ours"), (1, "trl")]
    assert _harness.schedule(("ours", "trl"), range(2, 4), rotate=True) == [
        (2, "ours"), (2, "trl"), (3, "trl"), (3, "ours")]
    assert [arm for _, arm in _harness.schedule(["a", "b", "c"], range(3), rotate=True)] == list("abcbcacab")


def test_time_limit_cuts_to_the_deadline_and_skips_under_the_minimum():
    now = time.time()
    assert _harness.time_limit(90.0, None) == 90.0
    assert _harness.time_limit(90.0, now + 1000) == 90.0
    assert 25.0 < _harness.time_limit(90.0, now + 30) <= 30.0
    assert _harness.time_limit(90.0, now + 5) is None  # under 10 s left: the caller skips the worker


def test_write_report_replaces_the_file_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "r.json"
    _harness.write_report(path, {"a": 1})
    _harness.write_report(path, {"a": 2, "b": [None]})
    assert (json.loads(path.read_text()) == {"a": 2, "b": [None]}
            and [p.name for p in tmp_path.iterdir()] == ["r.json"])


def test_summary_helpers_skip_missing_values():
    assert _harness.median([3.0, None, 1.0, 2.0]) == 2.0 and _harness.median([None]) is None
    assert _harness.mean([1.0, None, 2.0]) == 1.5 and _harness.mean([]) is None
    assert _harness.sd([1.0, 3.0]) == pytest.approx(2**0.5)  # sample sd: |a - b| / sqrt(2)
    assert _harness.sd([1.0, None]) is None


def test_versions_and_hardware_describe_the_run():
    versions = _harness.versions()
    assert set(versions) == {"python", "torch", "transformers", "peft", "trl", "accelerate"}
    assert versions["torch"] and versions["trl"] == (importlib.metadata.version("trl") if HAS_TRL else None)
    assert _harness.hardware("cpu").endswith(f"{os.cpu_count()} logical cores")


def test_the_sampler_ab_alternates_both_settings_and_reports_their_ratio(capsys):
    import sampler_ab

    assert sampler_ab.main(["--decoding", "dynamic", "--tokens", "4", "--calls", "3"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["rows"] == 8 and len(result["off_s"]) == len(result["on_s"]) == 1  # two calls are warm-up
    assert result["ratio"] == pytest.approx(result["on_s"][0] / result["off_s"][0])
    with pytest.raises(SystemExit):
        sampler_ab.main(["--setting", "merge_lora"])
    assert "needs an adapter to merge: pass --lora-r 16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sampler_ab.main(["--setting", "compiled_products", "--decoding", "dynamic"])
    assert "changes the compiled step: --decoding compiled, not 'dynamic'" in capsys.readouterr().err


def test_the_sampler_ab_times_each_product_and_a_steps_products(capsys):
    import sampler_ab

    assert sampler_ab.main(["--products", "--shape", "micro", "--prompts", "1", "--group-size", "2"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # micro: q, o 32 x 32; k, v 16 x 32; gate, up 64 x 32; down 32 x 64; the head 512 x 32
    assert [p["shape"] for p in result["products"]] == [[16, 32], [32, 32], [32, 64], [64, 32], [512, 32]]
    assert result["rows"] == 2 and result["step_products"]["products"] == 2 * 7 + 1
    assert all(result["step_products"][k] > 0 for k in ("blas_s", "reduction_s"))


def test_the_training_ab_alternates_both_settings_with_equal_gradients(capsys):
    import training_ab

    assert training_ab.main(["--shape", "micro", "--tokens", "8", "--prompt-tokens", "4",
                             "--passes", "3"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["rows"] == 4 and len(result["off_s"]) == len(result["on_s"]) == 1  # two passes are warm-up
    assert result["ratio"] == pytest.approx(result["on_s"][0] / result["off_s"][0])
    assert result["same_gradients"] is True  # kept logits: the recomputed ones, bit for bit
    with pytest.raises(SystemExit):
        training_ab.main(["--passes", "2"])
    assert "--passes 2: at least 3" in capsys.readouterr().err


def test_the_training_ab_compares_the_compiled_pass_with_both_keeping_logits(capsys, monkeypatch):
    import training_ab

    calls, real = [], training_ab.completion_logprobs

    def recording(*args, **kwargs):  # records what each pass asks for, then runs it eagerly (no compile)
        calls.append({k: kwargs[k] for k in ("keep_logits", "compiled")})
        return real(*args, **{**kwargs, "compiled": False})

    monkeypatch.setattr(training_ab, "completion_logprobs", recording)
    assert training_ab.main(["--setting", "compile_training", "--shape", "micro", "--tokens", "8",
                             "--prompt-tokens", "4", "--passes", "3"]) == 0
    assert calls == [{"keep_logits": True, "compiled": False}, {"keep_logits": True, "compiled": True}] * 3
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["gradient_difference"] == 0.0 and result["same_gradients"] is True


def test_the_training_ab_gradient_difference_is_relative_to_each_tensors_largest_entry():
    from training_ab import gradient_difference

    a = [torch.tensor([1.0, -4.0]), torch.tensor([0.5, 0.25])]
    assert gradient_difference(a, [t.clone() for t in a]) == 0.0
    # 0.01 apart on a tensor whose largest entry is 4; 0.001 apart on one whose largest is 0.5
    assert gradient_difference(a, [torch.tensor([1.01, -4.0]), torch.tensor([0.5, 0.251])]) == \
        pytest.approx(max(0.01 / 4, 0.001 / 0.5))
    assert gradient_difference([torch.zeros(3)], [torch.zeros(3)]) == 0.0
    assert gradient_difference(a, [torch.tensor([float("nan"), -4.0]), a[1]]) == float("inf")


# -- the timing boundaries of perf.py -------------------------------------------------------------


def test_our_loss_backward_is_the_gradient_pass_and_clipping_only(tmp_path, monkeypatch):
    """Work of the step outside the gradient pass (here the advantages, made 0.3 s slower) lands in
    other_s, not in loss_backward_s: ours is timed at TRL's boundary, not as the rest of the step."""
    import perf

    from grpo_engine.advantages import GroupNormalized

    real = GroupNormalized.__call__

    def slow(self, *args, **kwargs):
        time.sleep(0.3)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GroupNormalized, "__call__", slow)
    spec = dataclasses.replace(perf.PRESETS["micro"], measured_steps=1)
    raw = perf.run_ours(spec, str(tmp_path))
    for row in raw["rows"]:
        assert row["other_s"] >= 0.3 and row["loss_backward_s"] < 0.3, row
        assert row["step_s"] == pytest.approx(sum(row[k] for k in perf.STAGES), rel=1e-9)


# -- the head-pass comparison (benchmarks/head_pass.py) -------------------------------------------


@pytest.fixture(scope="module")
def head_pass_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("head") / "head_pass.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "head_pass.py"), "--smoke", "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_every_head_pass_arm_agrees_with_the_reference_on_the_smoke_shapes(head_pass_report):
    import head_pass

    report, stdout = head_pass_report
    assert report["ok"] and report["errors"] == [] and report["device"] == "cpu"
    for case in report["cases"]:
        expected = {a for a in head_pass.ARMS if head_pass.missing(a) is None}
        assert set(case["arms"]) == expected and set(case["skipped"]) == set(head_pass.ARMS) - expected
        assert {"ours-tiled", "ours-one", "plain"} <= expected
        for arm, r in case["arms"].items():
            assert r["ok"], (case["case"]["name"], arm, r["check"])
            assert r["check"]["grad_hidden"] <= case["tolerance"]
            assert (r["check"]["grad_weight"] is None) != case["case"]["train_head"]  # only a trained head's
        assert 0 < case["times"]["built_s"] <= case["times"]["checked_s"] <= case["times"]["timed_s"]
    float32 = report["cases"][0]
    assert float32["tolerance"] == 1e-4
    assert max(r["check"]["grad_weight"] for r in float32["arms"].values()) < 1e-5
    assert "head pass smoke-float32 (48 tokens x 64 -> 1,000, trained head, float32)" in stdout
    assert "all agree with the reference" in stdout


def test_liger_and_trl_fused_heads_are_compared_when_installed(head_pass_report):
    pytest.importorskip("liger_kernel.chunked_loss")
    pytest.importorskip("trl.kernels")
    report, _ = head_pass_report
    for case in report["cases"]:
        assert case["arms"]["liger"]["ok"] and case["arms"]["trl"]["ok"]
    assert report["versions"]["liger-kernel"]


def test_the_head_pass_check_catches_a_wrong_arm(monkeypatch):
    """An arm whose log-probs are at temperature 2 (a plausible slip) fails the check; the others pass."""
    import head_pass

    real = head_pass.arm_function

    def with_a_slip(arm, case, device):
        if arm != "plain":
            return real(arm, case, device)

        def run(x):
            logits = (x.hidden @ x.head.weight.T / 2).float()
            lp = logits.log_softmax(-1).gather(-1, x.targets[:, None]).squeeze(-1)
            return head_pass._loss(lp, x, case)
        return run

    monkeypatch.setattr(head_pass, "arm_function", with_a_slip)
    result = head_pass.measure_case(head_pass.SMOKE["smoke-float32"], "cpu", 1, ("ours-one", "plain"))
    assert result["arms"]["ours-one"]["ok"] and not result["arms"]["plain"]["ok"] and not result["ok"]


def test_a_head_pass_arm_that_fails_is_reported_and_the_others_go_on(monkeypatch):
    import head_pass

    real = head_pass.arm_function

    def out_of_memory(arm, case, device):
        if arm != "plain":
            return real(arm, case, device)

        def run(x):
            raise RuntimeError("CUDA out of memory. Tried to allocate 6.19 GiB")
        return run

    monkeypatch.setattr(head_pass, "arm_function", out_of_memory)
    result = head_pass.measure_case(head_pass.SMOKE["smoke-float32"], "cpu", 1, ("ours-one", "plain"))
    why = "failed: RuntimeError: CUDA out of memory. Tried to allocate 6.19 GiB"
    assert result["skipped"] == {"plain": why}
    assert set(result["arms"]) == {"ours-one"} and result["ok"] and len(result["arms"]["ours-one"]["ms"]) == 1
