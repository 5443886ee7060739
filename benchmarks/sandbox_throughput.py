"""Programs per second through ``grpo_engine.sandbox.run_python``, one and several at a time.

    python benchmarks/sandbox_throughput.py [--programs 60] [--parallel 1 2]

Each program is a small function and its assert (what a code reward runs per completion); the figure
is the sandbox's fixed cost per program: bubblewrap's namespaces, the limits, a fresh interpreter.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import _harness  # noqa: F401 - puts the repository on sys.path

from grpo_engine.sandbox import run_python

PROGRAM = "def f(n):\n    return n * n\n\nassert f(12) == 144\nprint('ok')\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=60)
    parser.add_argument("--parallel", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    run_python(PROGRAM)  # warm the page cache
    for workers in args.parallel:
        start = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(lambda _: run_python(PROGRAM, timeout_s=10), range(args.programs)))
        seconds = time.perf_counter() - start
        failed = sum(not r.ok for r in results)
        print(f"{workers} at a time: {args.programs / seconds:.1f} programs/s "
              f"({seconds / args.programs * 1000:.0f} ms each), {failed} failed", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
