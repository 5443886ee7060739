"""Checks everything the GPU run needs before any benchmark starts, and measures the machine's own
ceilings (run.sh's time plan gives it 55 s: a cold machine loads the CUDA libraries for ``import torch``
slowly, and every later process finds them cached).

    python benchmarks/gpu/preflight.py [--cpu] [--out preflight.json]

Fatal: Python, torch, CUDA and the GPU, a C compiler (Triton builds its launchers with one), every
import our worker makes (grpo_engine and its dependencies), math-verify verifying one answer, and
free GPU memory. Not fatal, recorded under ``"skip"`` so that run.sh leaves out only what needs them:
TRL (``from trl import GRPOConfig, GRPOTrainer``: TRL imports its modules lazily, so a bare
``import trl`` proves nothing) skips the TRL arms; bitsandbytes doing one 4-bit round trip on the GPU
skips the 4-bit preset; Liger-Kernel's fused GRPO loss not importing skips that arm of the head-pass
comparison (benchmarks/head_pass.py says so in its report).

Measured on the GPU, recorded for the figures' ceilings (``benchmarks/_measure.ceilings``): an
8192^3 bfloat16 matrix product (``matmul_tflops``, the mean of 10 after 3 warm-ups, CUDA events)
and a 2 GiB device-to-device copy (``copy_gb_per_s``, bytes read + written), beside the card's name.

Prints one line, ``preflight ok: ...`` or ``preflight FAILED: <check>: <what>; <fix>``, writes the same
as JSON, and exits 2 on a fatal failure. ``--cpu`` (the smoke run) skips the GPU checks;
``--quick`` (the second run, which runs neither TRL nor the head pass) skips the TRL and Liger checks.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import json
import shutil
import sys
import time
from pathlib import Path

MIN_FREE_GIB = 40.0  # the largest preset (gpu-7b-qlora's bfloat16 build before quantising) with room to spare
IMPORTS = ("pydantic", "yaml", "math_verify", "peft", "transformers", "datasets", "accelerate", "grpo_engine",
           "grpo_engine.sampling.static")
# what a failed optional check skips
SKIPS = {"trl": "the TRL arms", "nf4": "the 4-bit preset (gpu-7b-qlora)",
         "liger": "Liger's arm of the head-pass comparison"}


class Failed(Exception):
    def __init__(self, check: str, what: str, fix: str) -> None:
        super().__init__(f"{check}: {what}; {fix}")
        self.check = check


def run(cpu: bool, quick: bool = False) -> dict:
    found: dict = {"python": sys.version.split()[0]}
    if sys.version_info < (3, 10):  # noqa: UP036 - the device image is not ours: say so, do not crash
        raise Failed("python", f"Python {found['python']} is older than 3.10", "run with python3.10 or newer")
    try:
        import torch
    except ImportError as error:
        raise Failed("torch", f"cannot import torch ({error})", "install torch for this machine") from None
    found["torch"] = torch.__version__
    found["cuda"] = torch.version.cuda
    if not cpu:
        if not torch.cuda.is_available():
            raise Failed("cuda", f"torch {torch.__version__} sees no GPU",
                         "run on the GPU machine, or pass --cpu")
        free, total = torch.cuda.mem_get_info()
        found["gpu"] = torch.cuda.get_device_name()
        found["gpu_free_gib"] = round(free / 2**30, 1)
        found["gpu_total_gib"] = round(total / 2**30, 1)
        if free / 2**30 < MIN_FREE_GIB:
            raise Failed("memory",
                         f"{free / 2**30:.1f} GiB free on the GPU, the run needs {MIN_FREE_GIB:.0f}",
                         "free the GPU (another process holds it)")
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise Failed("compiler", "no C compiler (cc, gcc or clang) on PATH", "Triton needs one: install gcc")
    found["compiler"] = compiler
    versions = {}
    for name in IMPORTS:
        try:
            module = importlib.import_module(name)
        except Exception as error:  # an import can fail with any error, not only ImportError
            raise Failed("imports", f"import {name} failed ({type(error).__name__}: {str(error)[:200]})",
                         "carry its wheel in .whl/ (bash benchmarks/gpu/fetch_wheels.sh)") from None
        versions[name] = getattr(module, "__version__", None)
    found["versions"] = {k: v for k, v in versions.items() if v is not None}
    from math_verify import parse, verify

    if not verify(parse("$\\frac{1}{2}$"), parse("$0.5$")):
        raise Failed("math_verify", "1/2 and 0.5 were not verified equal",
                     "check the latex2sympy2 / antlr4 wheels")
    found["skip"] = {}
    checks = (("nf4", _nf4),) if quick else (("trl", _trl), ("nf4", _nf4), ("liger", _liger))
    for name, check in checks:
        why = check(torch, cpu)
        if why is not None:
            found["skip"][name] = why
    if not cpu:
        found.update(ceilings(torch))
    for name in ("trl", "bitsandbytes", "liger-kernel", "triton"):  # their versions, when installed
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found["versions"][name] = importlib.metadata.version(name)
    return found


def _trl(torch, cpu: bool) -> str | None:
    """Why the TRL arms cannot run (None: they can)."""
    try:
        from trl import GRPOConfig, GRPOTrainer  # noqa: F401 - the names the TRL worker imports
    except Exception as error:
        return f"from trl import GRPOConfig, GRPOTrainer failed ({type(error).__name__}: {str(error)[:200]})"
    return None


def _liger(torch, cpu: bool) -> str | None:
    """Why Liger's fused GRPO loss cannot run (None: it imports; pure torch, so on the CPU too)."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss  # noqa: F401 - head_pass's import
    except Exception as error:
        return (f"from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss failed "
                f"({type(error).__name__}: {str(error)[:200]})")
    return None


def ceilings(torch) -> dict:
    """The GPU's measured matrix-product rate and copy bandwidth (module docstring)."""
    n = 8192
    matmul_s = _timed(torch, lambda: torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
                      lambda a: torch.mm(a, a), 10)
    copy_s = _timed(torch, lambda: torch.empty(2**30, device="cuda", dtype=torch.int16),  # 2 GiB
                    lambda x: x.clone(), 10)
    torch.cuda.empty_cache()
    return {"matmul_tflops": round(2 * n**3 / matmul_s / 1e12, 1),
            "copy_gb_per_s": round(2 * 2**31 / copy_s / 1e9, 1)}


def _timed(torch, make, fn, repeats: int) -> float:
    """Seconds per ``fn(make())`` call: CUDA events around ``repeats`` calls after 3 warm-ups."""
    x = make()
    for _ in range(3):
        fn(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn(x)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / repeats


def _nf4(torch, cpu: bool) -> str | None:
    """Why the 4-bit preset cannot run (None: it can; on the CPU only the import is checked)."""
    try:
        import bitsandbytes.functional as bnbf
    except Exception as error:
        return f"import bitsandbytes failed ({type(error).__name__}: {str(error)[:200]})"
    if cpu:
        return None
    weight = torch.randn(128, 128, device="cuda", dtype=torch.bfloat16)
    try:
        packed, state = bnbf.quantize_4bit(weight, quant_type="nf4")
        error = (bnbf.dequantize_4bit(packed, state) - weight).abs().max().item()
    except Exception as failure:
        return (f"a 4-bit round trip on the GPU failed ({str(failure)[:200]}); carry a bitsandbytes wheel "
                "with this CUDA's library")
    return None if error < 0.5 else f"a 4-bit round trip is off by {error}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU smoke run: skip the GPU checks")
    parser.add_argument("--quick", action="store_true",
                        help="the second run: skip the TRL and Liger checks")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        found, line, code = run(args.cpu, args.quick), None, 0
        found["ok"] = True
        gpu = f"{found['gpu']} ({found['gpu_free_gib']} GiB free), " if "gpu" in found else ""
        if "matmul_tflops" in found:
            gpu += f"bf16 matmul {found['matmul_tflops']} TFLOP/s, copy {found['copy_gb_per_s']} GB/s, "
        skipped = "".join(f"; skipping {SKIPS[k]}: {why}" for k, why in found["skip"].items())
        line = (f"preflight ok: Python {found['python']}, torch {found['torch']} (CUDA {found['cuda']}), "
                f"{gpu}cc {found['compiler']}, {len(found['versions'])} packages import{skipped}")
    except Failed as failure:
        found, code = {"ok": False, "check": failure.check, "error": str(failure)}, 2
        line = f"preflight FAILED: {failure}"
    found["seconds"] = round(time.perf_counter() - start, 1)
    if args.out is not None:
        args.out.write_text(json.dumps(found, indent=1))
    print(line, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
