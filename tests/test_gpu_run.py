"""The GPU run's plumbing, proven on the CPU: `bash benchmarks/gpu/run.sh --cpu-smoke` end to end (the
same script, workers and JSON as on the GPU, presets shrunk), a preflight that stops the run, the
summary's goal verdicts, the wheel slimmer, and the roofline / MFU arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

import _measure  # noqa: E402
import slim_wheel  # noqa: E402
import summary  # noqa: E402

FILES = {"run.log", "preflight.json", "decode_check.json", "gpu-1.5b.json", "gpu-1.5b-8gib.json",
         "gpu-0.5b.json", "gpu-7b-qlora.json", "summary.txt"}


def run_script(out: Path, *args: str, extra_path: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    if extra_path:
        env["PYTHONPATH"] = extra_path + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "run.sh"), *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-smoke")
    proc = run_script(out, "--cpu-smoke")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_the_smoke_run_writes_every_file_the_gpu_run_returns(smoke):
    out, stdout = smoke
    assert {p.name for p in out.iterdir()} == FILES  # 8 files: the device tool returns at most 8
    assert json.loads((out / "preflight.json").read_text())["ok"] is True
    check = json.loads((out / "decode_check.json").read_text())
    assert check["ok"] and all(check["agreement"]["same_tokens"].values())
    assert set(check["speed"]["paths"]) == {"dynamic", "static"}
    assert "goals: not judged on a CPU smoke run" in stdout and "preset" in stdout


@pytest.mark.parametrize("preset,engines", [("gpu-1.5b", {"ours", "trl"}), ("gpu-1.5b-8gib", {"ours"}),
                                            ("gpu-0.5b", {"ours", "trl"}), ("gpu-7b-qlora", {"ours"})])
def test_each_preset_reports_what_the_gpu_run_needs(smoke, preset, engines):
    report = json.loads((smoke[0] / f"{preset}.json").read_text())
    assert report["errors"] == [] and report["problems"] == []
    assert {e for e in ("ours", "trl") if report[e]} == engines
    ours = report["ours"]
    assert ours["decoding"] == "static"  # the GPU's fixed-shape path, run eagerly on the CPU
    assert ours["prefill_s"] > 0 and ours["decode_s"] > 0
    assert ours["prefill_s"] + ours["decode_s"] <= ours["stages"]["generation_s"] * 1.01
    assert set(ours["phases_mib"]) == {"sampling", "training", "optimizer"}
    assert ours["first_step_s"] > ours["step_s"]  # launch, imports and the model build come first
    assert ours["predicted_peak_mib"] > 0 and ours["train_flops_per_step"] > 0
    for key in ("decode_roofline_fraction", "mfu"):
        assert key in ours and ours[key] is None  # no GPU ceiling applies on the CPU
    if "trl" in engines:
        assert report["settings_match"] is True
        assert ours["settings"]["compute_dtype"] == report["trl"]["settings"]["compute_dtype"]
    spec = report["spec"]
    assert spec["measured_steps"] >= 3 and len(report["runs"]["ours"][0]["steps"]) == 4


def test_mixed_precision_and_quantization_travel_into_the_smoke_run(smoke):
    half = json.loads((smoke[0] / "gpu-0.5b.json").read_text())
    assert half["ours"]["settings"]["weights_dtype"] == "float32"
    assert half["ours"]["settings"]["compute_dtype"] == "bfloat16"
    qlora = json.loads((smoke[0] / "gpu-7b-qlora.json").read_text())
    assert (qlora["spec"]["quantization"] == "nf4"
            and qlora["ours"]["settings"]["gradient_checkpointing"] is True)


def test_a_failed_preflight_stops_the_run_before_any_benchmark(tmp_path):
    broken = tmp_path / "site"
    (broken / "trl").mkdir(parents=True)
    (broken / "trl" / "__init__.py").write_text("raise ImportError('simulated: no trl on this machine')\n")
    out = tmp_path / "out"
    proc = run_script(out, "--cpu-smoke", extra_path=str(broken))
    assert proc.returncode == 2
    assert "preflight FAILED: imports: import trl failed (ImportError: simulated" in proc.stdout
    assert "STOP: preflight failed; no benchmark ran" in proc.stdout
    assert not list(out.glob("gpu-*.json"))


def test_summary_judges_each_goal_from_gpu_reports(tmp_path):
    def engine(step, reserved_gib, **extra):
        return {"step_s": step, "stages": {"generation_s": 1.0, "loss_backward_s": 1.0, "optimizer_s": 0.1},
                "peak_reserved_mib": reserved_gib * 1024, **extra}

    (tmp_path / "gpu-1.5b.json").write_text(json.dumps({
        "device": "cuda",
        "ours": engine(2.0, 7.5, decode_roofline_fraction=0.45, predicted_over_measured=1.1),
        "trl": engine(5.0, 30.0), "ratio_step_time": 0.4, "ratio_peak_memory": 0.4, "problems": [],
        "errors": []}))
    (tmp_path / "gpu-0.5b.json").write_text(json.dumps({
        "device": "cuda", "ours": engine(1.0, 9.0, mfu=0.30, predicted_over_measured=0.8), "trl": None,
        "ratio_step_time": None, "problems": [],
        "errors": ["trl: worker timed out after 110 s (its fixed limit)"]}))
    text = summary.summarize(tmp_path)
    assert "goal: step time ours / TRL <= 0.5 on gpu-1.5b: 0.40 (met)" in text
    assert "goal: step time ours / TRL <= 0.5 on gpu-0.5b: - (not measured)" in text
    assert "goal: decode at 32 rows >= 40% of the HBM roofline (gpu-1.5b, ours): 0.45 (met)" in text
    assert "goal: training >= 35% MFU on gpu-0.5b (ours): 0.30 (NOT met)" in text
    assert "peak reserved < 8 GiB (gpu-1.5b, ours), GiB: 7.50 (met)" in text
    assert "goal: 1.5B LoRA: peak allocated ours / TRL <= 0.35: 0.40 (NOT met)" in text
    assert "on gpu-0.5b (predicted / measured): 0.80 (NOT met)" in text
    assert "ERROR: trl: worker timed out" in text and "gpu-7b-qlora  did not run" in text
    assert "preflight: did not run" in text


def test_decode_roofline_and_mfu_by_hand():
    # Qwen2.5-1.5B-sized decode: 1.5e9 bf16 weights (3.0 GB), 32 rows at mean context 128 + 512 = 640 tokens
    # of 28,672 B each (0.587 GB), 1024 steps in 2.0 s: (3.0 + 0.587) GB x 1024 / 2 s = 1.837 TB/s
    r = _measure.decode_roofline(matmul_params=1_500_000_000, weight_bytes=2, lora_params=0, rows=32,
                                 prompt_tokens=128, completion_tokens=1024, kv_bytes_per_token=28_672,
                                 decode_s=2.0, hbm_bytes_per_s=4.3e12)
    assert r["kv_bytes_per_step"] == 32 * 640 * 28_672
    assert r["achieved_bytes_per_s"] == pytest.approx((3.0e9 + 32 * 640 * 28_672) * 1024 / 2.0)
    assert r["fraction"] == pytest.approx(r["achieved_bytes_per_s"] / 4.3e12)
    # LoRA with checkpointing: 4N + 2N recomputed = 6N per token, attention 4 x (2 x layers x q x L)
    m = _measure.training_mfu(matmul_params=10**9, layers=2, q_dim=100, trained_tokens=1000,
                              sequence_tokens=50, full=False, checkpointing=True, train_s=2.0,
                              peak_flops=1e13)
    assert m["flops_per_token"] == 6 * 10**9 + 4 * 2 * 2 * 100 * 50
    assert m["mfu"] == pytest.approx(m["flops_per_token"] * 1000 / 2.0 / 1e13)
    full = _measure.training_mfu(matmul_params=10**9, layers=2, q_dim=100, trained_tokens=1000,
                                 sequence_tokens=50, full=True, checkpointing=False, train_s=2.0)
    assert full["flops_per_token"] == 6 * 10**9 + 3 * 2 * 2 * 100 * 50


def test_slim_wheel_drops_members_and_their_record_lines(tmp_path):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    members = {"pkg/__init__.py": b"x = 1\n", "pkg/lib_cuda118.so": b"\0" * 1000,
               "pkg/lib_cuda130.so": b"\1" * 10, "pkg-1.0.dist-info/METADATA": b"Name: pkg\n"}
    record = "".join(f"{name},sha256=abc,{len(data)}\n" for name, data in members.items()) + \
        "pkg-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr("pkg-1.0.dist-info/RECORD", record)
    assert slim_wheel.slim(wheel, ["pkg/lib_cuda1[0-2]*"]) == ["pkg/lib_cuda118.so"]
    with zipfile.ZipFile(wheel) as z:
        assert set(z.namelist()) == set(members) - {"pkg/lib_cuda118.so"} | {"pkg-1.0.dist-info/RECORD"}
        lines = z.read("pkg-1.0.dist-info/RECORD").decode().splitlines()
        assert not any(line.startswith("pkg/lib_cuda118.so") for line in lines) and len(lines) == 4
        assert z.read("pkg/lib_cuda130.so") == b"\1" * 10
    with pytest.raises(ValueError, match="no file of pkg-1.0-py3-none-any.whl matches"):
        slim_wheel.slim(wheel, ["pkg/lib_rocm*"])
