"""The supervisor of one sandboxed program: it writes the program's stdin, reads its stdout and stderr and
watches its limits, all in one loop that never blocks (``select`` on the pipes and a pidfd), under one
wall-time limit; it kills the program's session and cgroup when a limit is hit, reaps it, and names the
stop reason from what it observed itself: the kernel's counts in the run's cgroup (out-of-memory kills,
refused forks, CPU time), the CPU time of the reaped processes (``wait4``), the kills it sent, and
without a cgroup the program's task count when it was killed. Never the program's output or exit status:
a program can print ``MemoryError`` or exit with 152 (bwrap's status for SIGXCPU) without hitting a limit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import signal
import subprocess
import time
from pathlib import Path

from grpo_engine import cgroup

__all__ = ["STOPS", "Outcome", "Watch", "reason", "supervise"]

STOPS = ("memory", "processes", "cpu", "output", "timeout")  # the stop reasons, first match wins


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What the supervisor saw (``grpo_engine.sandbox.SandboxResult`` documents each field)."""

    stdout: str
    stderr: str
    exit_code: int | None
    stopped: str | None
    seconds: float
    memory_peak_mb: float | None


@dataclasses.dataclass(frozen=True)
class Watch:
    """What the supervisor enforces: wall time, output, CPU seconds, and the run's group (or, without
    one, the task count at the process cap)."""

    timeout_s: float
    max_output: int
    cpu_s: float
    group: cgroup.RunGroup | None
    task_cap: int


def supervise(cmd: list[str], fds: tuple[int, ...], stdin: bytes, watch: Watch) -> Outcome:
    """Runs ``cmd`` (keeping the open files ``fds``) with ``stdin`` until it ends or a limit of ``watch``
    is hit, and returns what it printed, its status and the stop reason the supervisor saw."""
    start = time.monotonic()
    # its own session (a process group to kill), none of the trainer's environment; no preexec_fn, which
    # is unsafe in a process with threads
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, env={"PATH": "/usr/bin:/bin"}, pass_fds=fds)
    try:
        out, killed, at_cap = _pump(proc, stdin, start + watch.timeout_s, watch)
    finally:
        if proc.returncode is None:  # an exception here (KeyboardInterrupt) leaves nothing running
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    _, status, usage = os.wait4(proc.pid, 0)  # the CPU time of it and every process it reaped
    proc.returncode = code = os.waitstatus_to_exitcode(status)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        with contextlib.suppress(OSError):
            pipe.close()
    seconds = time.monotonic() - start
    code = 128 - code if code > 128 else code  # bwrap reports its program's death by signal N as 128 + N
    events = watch.group.events() if watch.group is not None else cgroup.Events(0, 0, None)
    cpu = max(usage.ru_utime + usage.ru_stime, events.cpu_s or 0.0)
    stopped = reason(killed, code, events, at_cap, cpu >= 0.99 * watch.cpu_s)
    stdout, stderr = (bytes(b[:watch.max_output]).decode("utf-8", "replace") for b in out)
    peak = None if events.peak_bytes is None else events.peak_bytes / (1 << 20)
    return Outcome(stdout, stderr, None if killed else code, stopped, seconds, peak)


def _pump(proc: subprocess.Popen, stdin: bytes, deadline: float,
          watch: Watch) -> tuple[tuple[bytearray, bytearray], str | None, bool]:
    """Writes stdin, reads stdout and stderr, and watches the limits, all without blocking, until the
    program has exited and closed its output, or a limit is hit (then kills it). Returns the output, the
    limit it was killed for (or None) and, without a cgroup, whether it held its whole process cap."""
    out = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    reading, pending, killed = list(out), memoryview(stdin), None
    writing = [proc.stdin.fileno()] if pending else []
    if pending:
        os.set_blocking(writing[0], False)
    else:
        proc.stdin.close()
    exited = _Exit(proc.pid)
    next_look = 0.0
    while reading or not exited.done:
        now = time.monotonic()
        if now >= deadline:
            killed = "timeout"
            break
        ready, free, _ = select.select(reading + exited.fds, writing, [], min(deadline - now, exited.wait))
        for fd in ready:
            if fd in out:
                chunk = os.read(fd, 1 << 16)
                out[fd] += chunk
                if not chunk:
                    reading.remove(fd)
        if free:
            pending = _feed(proc, pending)
            writing = writing if pending else []
        exited.check()
        if sum(len(b) for b in out.values()) > watch.max_output:
            killed = "output"
            break
        if watch.group is not None and not exited.done and time.monotonic() >= next_look:
            next_look, killed = time.monotonic() + 0.02, limit_hit(watch)
            if killed:  # every process of it is killed: an out-of-memory kill may have taken one only
                break
    at_cap = killed is not None and watch.group is None and _tasks(proc.pid) >= watch.task_cap
    if killed is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # bwrap and, through its PID namespace, everything inside
        if watch.group is not None:
            watch.group.kill()
    exited.close()
    return (out[proc.stdout.fileno()], out[proc.stderr.fileno()]), killed, at_cap


def _feed(proc: subprocess.Popen, pending: memoryview) -> memoryview:
    """Writes what the pipe takes now; closes stdin once all is written or the program closed it."""
    try:
        pending = pending[os.write(proc.stdin.fileno(), pending[:1 << 16]):]
    except BlockingIOError:
        return pending
    except BrokenPipeError:
        pending = pending[:0]
    if not pending:
        proc.stdin.close()
    return pending


def limit_hit(watch: Watch) -> str | None:
    """A limit the run's cgroup counted: an out-of-memory kill, a refused fork, the CPU seconds spent."""
    events = watch.group.events()
    if events.oom_kills:
        return "memory"
    if events.pids_max:
        return "processes"
    if events.cpu_s is not None and events.cpu_s >= watch.cpu_s:
        return "cpu"
    return None


class _Exit:
    """Whether the process has exited, without reaping it (its rusage is read when it is reaped): a
    pidfd that select reports readable, or a short poll where the kernel has none."""

    def __init__(self, pid: int) -> None:
        self.pid, self.done = pid, False
        try:
            self.pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self.pidfd = None

    @property
    def fds(self) -> list[int]:
        return [self.pidfd] if self.pidfd is not None and not self.done else []

    @property
    def wait(self) -> float:
        return 0.1 if self.pidfd is not None or self.done else 0.005

    def check(self) -> None:
        if not self.done:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            self.done = info is not None

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)


def _tasks(pid: int) -> int:
    """Processes and threads below ``pid`` (its children, theirs, ...), read from /proc."""
    count, stack = 0, [pid]
    while stack:
        for task in Path(f"/proc/{stack.pop()}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError):
                children = [int(c) for c in (task / "children").read_text().split()]
                stack += children
                count += len(children)
                count += sum(len(os.listdir(f"/proc/{c}/task")) - 1 for c in children)
    return count


def reason(killed: str | None, code: int, events: cgroup.Events, at_cap: bool, cpu_spent: bool) -> str | None:
    """The stop reason from what the supervisor observed (``STOPS``, first match): the kernel's counts (a
    limit it enforced is the reason even when the program went on to exit 0), its own kills, the CPU time
    of the reaped processes; never the program's output or exit status."""
    failed = killed is not None or code != 0
    seen = {"memory": events.oom_kills > 0, "processes": events.pids_max > 0 or at_cap,
            "cpu": killed == "cpu" or (failed and cpu_spent), "output": killed == "output",
            "timeout": killed == "timeout"}
    return next((stop for stop in STOPS if seen[stop]), None)
