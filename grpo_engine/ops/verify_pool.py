"""Answer verification in worker processes, where a runaway parse cannot hang or swell the run.

:class:`VerifyPool` keeps a few ``verify_worker.py`` processes (plain Python with math-verify, no torch)
and hands them (gold, answer) pairs, one at a time each, over JSON lines. A pair that has no result
within ``timeout_s`` gets its worker killed and replaced, and is reported as timed out; a worker that
dies is replaced too. :func:`shared_pool` is the process-wide pool, started on first use and closed
at exit.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["VerifyPool", "shared_pool"]

WORKER = Path(__file__).with_name("verify_worker.py")


class VerifyPool:
    """Worker processes that verify answers with math-verify (see the module docstring).

    Args:
        workers: processes (each imports math-verify once, about a second).
        timeout_s: seconds a pair may take before its worker is killed (math-verify's own timeouts,
            5 s for parsing and for comparing, normally end it first).
    """

    def __init__(self, workers: int = 2, timeout_s: float = 15.0) -> None:
        self.size, self.timeout_s = max(1, workers), timeout_s
        self._idle: list[subprocess.Popen] = []

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, bufsize=1,
                                env={**os.environ, "PYTHONWARNINGS": "ignore"})

    def verify(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[bool | None, str | None]]:
        """``(equal, error)`` per (gold, answer) pair: ``error`` is None when math-verify decided,
        ``"gold"`` when the gold answer does not parse, else why there is no decision."""
        results: list[tuple[bool | None, str | None]] = [(None, "not verified")] * len(pairs)
        todo = collections.deque(range(len(pairs)))
        busy: dict[int, tuple[subprocess.Popen, int, float]] = {}  # stdout fd -> (worker, pair, start)
        while todo or busy:
            while todo and len(busy) < self.size:
                worker = self._idle.pop() if self._idle else self._start()
                i = todo.popleft()
                try:
                    worker.stdin.write(json.dumps({"id": i, "gold": pairs[i][0], "answer": pairs[i][1]})
                                       + "\n")
                    worker.stdin.flush()
                except OSError:  # it died since its last pair: try again with a new one
                    worker.kill()
                    worker.wait()
                    todo.appendleft(i)
                    continue
                busy[worker.stdout.fileno()] = (worker, i, time.monotonic())
            ready, _, _ = select.select(list(busy), [], [], 0.05)
            for fd in ready:
                worker, i, _ = busy.pop(fd)
                line = worker.stdout.readline()
                if not line:  # the worker died on this pair
                    worker.kill()
                    worker.wait()
                    results[i] = (None, "the verifier process died")
                    continue
                out = json.loads(line)
                results[i] = (out["equal"], out["error"])
                self._idle.append(worker)
            now = time.monotonic()
            for fd, (worker, i, start) in list(busy.items()):
                if now - start > self.timeout_s:  # a runaway parse: kill it, the next pair gets a new worker
                    worker.kill()
                    worker.wait()
                    del busy[fd]
                    results[i] = (None, f"timed out after {self.timeout_s:.0f} s")
        return results

    def close(self) -> None:
        for worker in self._idle:
            worker.kill()
            worker.wait()
        self._idle.clear()


_SHARED: VerifyPool | None = None


def shared_pool() -> VerifyPool:
    """The process-wide pool (two workers at most, one on a single-core machine)."""
    global _SHARED
    if _SHARED is None:
        _SHARED = VerifyPool(workers=min(2, os.cpu_count() or 1))
        atexit.register(_SHARED.close)
    return _SHARED
