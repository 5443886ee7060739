"""Checks, in well under 30 s, everything the GPU run needs before any benchmark starts.

    python benchmarks/gpu/preflight.py [--cpu] [--out preflight.json]

Python, torch, CUDA and the GPU, a C compiler (Triton builds its launchers with one), every import a
worker makes (grpo_engine and its dependencies, TRL, bitsandbytes with its CUDA library doing one
4-bit round trip, math-verify verifying one answer), and free GPU memory. Prints one line,
``preflight ok: ...`` or ``preflight FAILED: <check>: <what>; <fix>``, writes the same as JSON, and
exits 2 on failure. ``--cpu`` (the smoke run) skips the GPU checks.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import time
from pathlib import Path

MIN_FREE_GIB = 40.0  # the largest preset (gpu-7b-qlora's bfloat16 build before quantising) with room to spare
IMPORTS = ("pydantic", "yaml", "math_verify", "peft", "transformers", "datasets", "accelerate", "trl",
           "bitsandbytes", "grpo_engine", "grpo_engine.sampling.static")


class Failed(Exception):
    def __init__(self, check: str, what: str, fix: str) -> None:
        super().__init__(f"{check}: {what}; {fix}")
        self.check = check


def run(cpu: bool) -> dict:
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
    if not cpu:
        import bitsandbytes.functional as bnbf

        weight = torch.randn(128, 128, device="cuda", dtype=torch.bfloat16)
        try:
            packed, state = bnbf.quantize_4bit(weight, quant_type="nf4")
            error = (bnbf.dequantize_4bit(packed, state) - weight).abs().max().item()
        except Exception as failure:
            raise Failed("bitsandbytes", f"a 4-bit round trip on the GPU failed ({str(failure)[:200]})",
                         "carry a bitsandbytes wheel with this CUDA's library (fetch_wheels.sh)") from None
        if not error < 0.5:
            raise Failed("bitsandbytes", f"a 4-bit round trip is off by {error}",
                         "check the bitsandbytes wheel")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU smoke run: skip the GPU checks")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        found, line, code = run(args.cpu), None, 0
        found["ok"] = True
        gpu = f"{found['gpu']} ({found['gpu_free_gib']} GiB free), " if "gpu" in found else ""
        line = (f"preflight ok: Python {found['python']}, torch {found['torch']} (CUDA {found['cuda']}), "
                f"{gpu}cc {found['compiler']}, {len(found['versions'])} packages import")
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
