"""One table from a GPU run's JSON files, and each of the project's GPU goals against what was measured.

    python benchmarks/gpu/summary.py OUT_DIR      # prints the table (run.sh also writes summary.txt)

Reads whatever the run left: ``preflight.json`` (with the measured ceilings), ``timeline.jsonl`` (each
stage's limit and time), ``decode_check.json``, one ``<preset>.json`` per preset (``benchmarks/perf.py
--out``) and ``head_pass.json`` (``benchmarks/head_pass.py --out``); a preset that did not run, or an
engine that failed, shows as such, and a goal whose figure is in the other run is "not measured" here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from head_pass import summary_line  # noqa: E402

PRESETS = ("gpu-0.5b", "gpu-1.5b", "gpu-7b-qlora")  # in the order run.sh runs them
GIB = 1024.0  # MiB per GiB


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _f(value, fmt: str = ".2f", missing: str = "-") -> str:
    return missing if value is None else format(value, fmt)


def _gib(mib: float | None) -> float | None:
    return None if mib is None else mib / GIB


def _row(preset: str, engine: str, r: dict) -> str:
    st, phases = r["stages"], r.get("phases_mib") or {}
    peak = "/".join(_f(_gib((phases.get(k) or {}).get("allocated_mib")), ".1f")
                    for k in ("sampling", "training", "optimizer"))
    reserved = _gib(r.get("peak_reserved_mib"))
    predicted = r.get("predicted_over_measured")
    return (f"{preset:14}{engine:6}{r['step_s']:8.2f}{st['generation_s']:8.2f}{_f(r.get('prefill_s')):>8}"
            f"{_f(r.get('decode_s')):>8}{st['loss_backward_s']:8.2f}{st['optimizer_s']:7.2f}"
            f"{_f(r.get('tokens_per_s'), '.0f'):>9}{_f(r.get('decode_roofline_fraction'), '.0%'):>6}"
            f"{_f(r.get('mfu'), '.0%'):>6}{_f(r.get('mfu_spec'), '.0%'):>6}{peak:>16}{_f(reserved, '.1f'):>7}"
            f"{_f(r.get('first_step_s'), '.0f'):>6}{_f(predicted):>7}  {r.get('decoding', '')}")


def _goals(reports: dict[str, dict]) -> list[str]:
    lines = []

    def goal(text: str, value, ok) -> None:
        verdict = "not measured" if value is None else ("met" if ok(value) else "NOT met")
        lines.append(f"goal: {text}: {_f(value, '.2f')} ({verdict})")

    def get(preset: str, *keys):
        value = reports.get(preset)
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    for preset in ("gpu-0.5b", "gpu-1.5b"):
        goal(f"loss + backward ours / TRL <= 0.8 on {preset}", get(preset, "ratio_loss_backward"),
             lambda v: v <= 0.8)
    for preset in ("gpu-0.5b", "gpu-1.5b"):
        goal(f"step time ours / TRL <= 0.5 on {preset}", get(preset, "ratio_step_time"), lambda v: v <= 0.5)
    goal("decode at 32 rows >= 40% of the HBM roofline (gpu-1.5b, ours; the measured copy rate)",
         get("gpu-1.5b", "ours", "decode_roofline_fraction"), lambda v: v >= 0.40)
    goal("training >= 35% MFU on gpu-0.5b (ours; the measured matmul ceiling)",
         get("gpu-0.5b", "ours", "mfu"), lambda v: v >= 0.35)
    goal("1.5B LoRA r16, 4 x 8 x 1024 under the 8 GiB plan: peak reserved < 8 GiB (gpu-1.5b, ours), GiB",
         _gib(get("gpu-1.5b", "ours", "peak_reserved_mib")), lambda v: v < 8)
    goal("1.5B LoRA, both under the 8 GiB plan: peak allocated ours / TRL <= 0.35",
         get("gpu-1.5b", "ratio_peak_memory"), lambda v: v <= 0.35)
    goal("7B QLoRA: peak reserved < 12 GiB, GiB", _gib(get("gpu-7b-qlora", "ours", "peak_reserved_mib")),
         lambda v: v < 12)
    for preset in PRESETS:
        goal(f"estimator within 15% of the allocated peak on {preset} (predicted / measured)",
             get(preset, "ours", "predicted_over_measured"), lambda v: 0.85 <= v <= 1.15)
    return lines


def _timeline(out: Path) -> list[str]:
    """Each stage's time against its limit, in one line."""
    try:
        text = (out / "timeline.jsonl").read_text()
        stages = [json.loads(line) for line in text.splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError):
        return []
    def part(s: dict) -> str:
        if s.get("skipped"):
            return f"{s['stage']} skipped"
        failed = f" (exit {s['rc']})" if s["rc"] else ""
        return f"{s['stage']} {s['end_s'] - s['start_s']}/{s['limit_s']} s{failed}"

    parts = [part(s) for s in stages]
    return ["timeline (used / limit): " + ", ".join(parts)] if parts else []


def summarize(out: Path) -> str:
    lines = []
    preflight = _load(out / "preflight.json")
    if preflight is None:
        lines.append("preflight: did not run")
    elif preflight.get("ok"):
        ceilings = (f"; measured: bf16 matmul {preflight['matmul_tflops']} TFLOP/s, copy "
                    f"{preflight['copy_gb_per_s']} GB/s" if preflight.get("matmul_tflops") else "")
        lines.append(f"preflight: ok, Python {preflight['python']}, torch {preflight['torch']}, "
                     f"{preflight.get('gpu', 'CPU')}{ceilings}; " + ", ".join(
                         f"{k} {v}" for k, v in preflight.get("versions", {}).items()))
    else:
        lines.append(f"preflight: FAILED, {preflight.get('error')}")
    lines += _timeline(out)
    check = _load(out / "decode_check.json")
    if check is None:
        lines.append("decode check: did not run")
    if check is not None and "agreement" in check:
        a = check["agreement"]
        lines.append("decode check: same tokens on every path: "
                     f"{all(a.get('same_tokens', {0: False}).values())} "
                     f"{a.get('same_tokens')}, max log-prob difference "
                     f"{_f(max(a.get('max_logprob_diff', {'-': 0}).values()), '.1e')}")
    if check is not None and "speed" in check:
        s = check["speed"]
        paths = ", ".join(f"{p} {v['tokens_per_s']:.0f} tok/s" for p, v in s["paths"].items())
        lines.append(f"decode speed at {s['rows']} rows x {s['new_tokens']} tokens: {paths}; "
                     f"auto picks {s['auto']}")
    reports = {p: r for p in PRESETS if (r := _load(out / f"{p}.json")) is not None}
    if reports:
        any_report = next(iter(reports.values()))
        v = any_report.get("versions", {})
        lines.append(f"hardware: {any_report.get('hardware')}; torch {v.get('torch')}, transformers "
                     f"{v.get('transformers')}, peft {v.get('peft')}, TRL {v.get('trl')} (TRL without vLLM)")
    lines.append(f"{'preset':14}{'engine':6}{'step s':>8}{'gen s':>8}{'prefill':>8}{'decode':>8}"
                 f"{'train s':>8}{'opt s':>7}{'gen t/s':>9}{'roof':>6}{'MFU':>6}{'spec':>6}"
                 f"{'peak GiB s/t/o':>16}{'resv':>7}{'1st s':>6}{'pred/m':>7}  decoding")
    for preset in PRESETS:
        report = reports.get(preset)
        if report is None:
            lines.append(f"{preset:14}did not run")
            continue
        for engine in ("ours", "trl"):
            if report.get(engine):
                lines.append(_row(preset, engine, report[engine]))
        if report.get("ratio_step_time") is not None:
            lines.append(f"{'':14}ours / TRL: step time {report['ratio_step_time']:.2f}, loss + backward "
                         f"{_f(report.get('ratio_loss_backward'))}, peak allocated "
                         f"{report['ratio_peak_memory']:.2f}, generation tokens/s "
                         f"{_f(report.get('ratio_generation_tokens_per_s'))}")
        alone = [e for e in ("ours", "trl") if report.get(e)] if preset != "gpu-7b-qlora" else []
        if len(alone) == 1 and report.get("device") == "cuda" and not report.get("errors"):
            lines.append(f"{'':14}NOTE: only {alone[0]} in this run (gpu-1.5b: ours in part 1, TRL in "
                         "part 2); benchmarks/gpu/table.py --keep joins the parts and judges what needs both")
        partial = [e for e in ("ours", "trl") if (report.get(e) or {}).get("partial")]
        if partial:
            steps = ", ".join(f"{report[e]['measured_steps']} measured step(s) of {e}" for e in partial)
            lines.append(f"{'':14}NOTE: {', '.join(partial)} stopped early: the figures are from {steps}")
        if (report.get("ours") or {}).get("decoding_fallback"):
            lines.append(f"{'':14}NOTE: no CUDA graph, decoded eagerly: "
                         f"{report['ours']['decoding_fallback']}")
        lines += [f"{'':14}PROBLEM: {x}" for x in report.get("problems", [])]
        lines += [f"{'':14}ERROR: {x.splitlines()[0]}" for x in report.get("errors", [])]
    head = _load(out / "head_pass.json")
    if head is not None:
        lines += [summary_line(case, head.get("device", "cuda")) for case in head.get("cases", [])]
        lines += [f"head pass ERROR: {e.splitlines()[0]}" for e in head.get("errors", [])]
    if reports and all(r.get("device") == "cpu" for r in reports.values()):
        lines.append("goals: not judged on a CPU smoke run (they are the GPU run's)")
    else:
        lines += _goals(reports)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    print(summarize(Path(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
