"""Running a program a model wrote, isolated from the trainer: ``run_python(code, ...)``.

Each program runs in its own process inside bubblewrap (``bwrap``, Debian / Ubuntu package
``bubblewrap``): new user, PID, network, mount, IPC and UTS namespaces, all capabilities dropped, a new
session (no terminal), an empty environment, a read-only view of the Python installation and the
system libraries, an empty ``/tmp``, and one scratch directory it may write (``/scratch``, its working
directory, deleted afterwards). Around it, limits the kernel enforces: CPU seconds, address space
(memory), file size, open files, no core dumps (``setrlimit``); the number of processes and threads
(a ``pids`` cgroup, or for a user who is not root ``RLIMIT_NPROC``);
and, from here, wall time and output size.

Fail closed: without bwrap, or without a way to cap the number of processes (root without a
writable ``pids`` cgroup), :func:`run_python` refuses with :class:`SandboxUnavailable` and says
what to install. docs/sandbox.md lists each threat and where it is stopped.

Example:
    >>> # run_python("print(6 * 7)", timeout_s=5).stdout
    >>> # '42\\n'
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

__all__ = ["SandboxResult", "SandboxUnavailable", "run_python", "sandbox_available"]

_PIDS_V1 = Path("/sys/fs/cgroup/pids")


class SandboxUnavailable(RuntimeError):
    """The isolation the sandbox needs is not available on this machine (the message says what to do)."""


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What a program did.

    Attributes:
        stdout, stderr: its output, decoded as UTF-8 (bad bytes replaced), each cut at the output limit.
        exit_code: its exit status; -N when signal N ended it (bwrap's 128 + N); None when the sandbox
            killed it (``stopped`` says why).
        stopped: None when it ended on its own, else why it was stopped or failed: ``"timeout"`` (wall
            time), ``"cpu"`` (CPU seconds), ``"memory"`` (address space), ``"output"`` (too much
            stdout + stderr), ``"file_size"`` (a file over the limit), ``"processes"`` (it tried to
            start more processes or threads than allowed), ``"signal"`` (a crash, e.g. SIGSEGV).
        seconds: wall time.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    stopped: str | None
    seconds: float

    @property
    def ok(self) -> bool:
        """It ended on its own with status 0."""
        return self.stopped is None and self.exit_code == 0


def _python() -> Path:
    """The real interpreter behind this one (a venv's ``python`` is a link to it)."""
    return Path(os.path.realpath(sys.executable))


def _binds() -> list[str]:
    """Read-only views: the system directories a dynamically linked Python needs, and its installation."""
    args: list[str] = []
    for path in ("/usr", "/lib", "/lib64", "/bin", "/etc/alternatives", "/etc/ld.so.cache"):
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    prefix = Path(sys.base_prefix).resolve()
    if not str(prefix).startswith("/usr"):
        args += ["--ro-bind", str(prefix), str(prefix)]
    return args


def _user_tasks(uid: int) -> int:
    """Processes and threads this user runs now (RLIMIT_NPROC counts all of them)."""
    count = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
    return count


class _ProcessCap:
    """Caps the number of processes and threads of one run: a fresh ``pids`` cgroup (v1 hierarchy) when
    this process may create one, else (a user who is not root) ``RLIMIT_NPROC`` set to the tasks the user
    runs now plus ``limit``: the kernel counts every task of the user against it, the trainer's threads
    included, so the cap is exact only while the user starts nothing else meanwhile. Root is exempt from
    RLIMIT_NPROC, so for root only the cgroup counts."""

    def __init__(self, limit: int) -> None:
        self.limit, self.group, self.nproc = limit, None, None
        if _PIDS_V1.is_dir() and os.access(_PIDS_V1, os.W_OK):
            group = _PIDS_V1 / f"grpo-sandbox-{uuid.uuid4().hex[:12]}"
            with contextlib.suppress(OSError):
                group.mkdir()
                (group / "pids.max").write_text(str(limit))
                self.group = group
        if self.group is None and os.geteuid() == 0:
            raise SandboxUnavailable(
                "the sandbox cannot cap the number of processes: running as root, RLIMIT_NPROC does not "
                f"hold, and no writable pids cgroup ({_PIDS_V1}); run the trainer as a normal user, or "
                "give it a pids cgroup")
        if self.group is None:
            self.nproc = _user_tasks(os.getuid()) + limit

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` started inside the cap: a shell that moves itself into the cgroup, then becomes the
        command (nothing runs outside it, and no Python runs between fork and exec), or ``prlimit``'s
        ``--nproc``."""
        if self.group is not None:
            return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.group / "cgroup.procs"), *cmd]
        return ["prlimit", f"--nproc={self.nproc}", "--", *cmd]

    def hit(self, stderr: str) -> bool:
        """Whether a fork or a thread was refused for the cap (the cgroup's count, else the error)."""
        if self.group is None:
            return "BlockingIOError" in stderr or "can't start new thread" in stderr
        with contextlib.suppress(OSError, ValueError):
            return int((self.group / "pids.events").read_text().split()[1]) > 0
        return False

    def close(self) -> None:
        if self.group is not None:
            with contextlib.suppress(OSError):
                for pid in (self.group / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            for _ in range(50):  # the killed processes leave the group as they are reaped
                try:
                    self.group.rmdir()
                    return
                except OSError:
                    time.sleep(0.02)


def sandbox_available() -> str | None:
    """None when :func:`run_python` can run here, else why not."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (apt install bubblewrap, or dnf install bubblewrap)"
    if shutil.which("prlimit") is None:
        return "prlimit (util-linux) is not installed"
    if os.geteuid() == 0 and not (_PIDS_V1.is_dir() and os.access(_PIDS_V1, os.W_OK)):
        return "running as root without a writable pids cgroup: the number of processes cannot be capped"
    return _namespaces()


@functools.lru_cache(maxsize=1)
def _namespaces() -> str | None:
    """Whether bwrap can create its namespaces here (a kernel or container may forbid user namespaces)."""
    try:
        probe = subprocess.run(["bwrap", "--unshare-all", "--ro-bind", "/", "/", "true"], capture_output=True,
                               text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"bubblewrap could not start ({error})"
    if probe.returncode != 0:
        return (f"bubblewrap cannot create its namespaces here ({probe.stderr.strip()[:200]}); enable "
                "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1)")
    return None


def run_python(code: str, *, timeout_s: float = 10.0, memory_mb: int = 512, cpu_s: int | None = None,
               max_processes: int = 8, max_output_bytes: int = 1 << 16, max_file_mb: int = 16,
               stdin: str = "") -> SandboxResult:
    """Runs ``code`` with this machine's Python (``-I``: no site-packages, no user paths) in the sandbox.

    Args:
        code: the program's source (it is written to the scratch directory, never evaluated here).
        timeout_s: wall time before it is killed.
        memory_mb: address space per process.
        cpu_s: CPU seconds (default: ``timeout_s`` rounded up).
        max_processes: processes and threads together, the first one included.
        max_output_bytes: stdout + stderr kept; past it the program is killed.
        max_file_mb: the largest file it may write.
        stdin: its standard input.

    Raises:
        SandboxUnavailable: no bubblewrap, or no way to cap the processes (see :func:`sandbox_available`).
        ValueError: a limit that is not positive.
    """
    for name, value in (("timeout_s", timeout_s), ("memory_mb", memory_mb), ("max_processes", max_processes),
                        ("max_output_bytes", max_output_bytes), ("max_file_mb", max_file_mb)):
        if not value > 0:
            raise ValueError(f"run_python: {name}={value!r} must be > 0")
    why = sandbox_available()
    if why is not None:
        raise SandboxUnavailable(f"run_python refuses to run: {why}")
    cpu = int(cpu_s if cpu_s is not None else -(-timeout_s // 1))
    cap = _ProcessCap(max_processes)
    scratch = Path(tempfile.mkdtemp(prefix="grpo-sandbox-"))
    try:
        (scratch / "main.py").write_text(code, encoding="utf-8")
        cmd = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
               "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/scratch",
               "--setenv", "TMPDIR", "/scratch", "--setenv", "PYTHONDONTWRITEBYTECODE", "1", *_binds(),
               "--proc", "/proc", "--dev", "/dev", "--bind", str(scratch), "/scratch", "--remount-ro", "/",
               "--chdir", "/scratch", "--", str(_python()), "-I", "main.py"]

        # limits inherited by bwrap and the program; CPU: SIGXCPU, then SIGKILL a second later
        limits = ["prlimit", f"--cpu={cpu}:{cpu + 1}", f"--as={memory_mb << 20}",
                  f"--fsize={max_file_mb << 20}", "--nofile=64", "--core=0", "--"]
        return _supervise(cap.wrap(limits + cmd), stdin, timeout_s, max_output_bytes, cap)
    finally:
        cap.close()
        shutil.rmtree(scratch, ignore_errors=True)


def _supervise(cmd: list[str], stdin: str, timeout_s: float, max_output: int,
               cap: _ProcessCap) -> SandboxResult:
    start = time.monotonic()
    # its own session (a process group to kill), none of the trainer's environment; no preexec_fn, which
    # is unsafe in a process with threads
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, env={"PATH": "/usr/bin:/bin"})
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.write(stdin.encode())
    proc.stdin.close()
    out = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    stopped = None
    open_pipes = [proc.stdout, proc.stderr]
    while open_pipes:
        left = timeout_s - (time.monotonic() - start)
        if left <= 0:
            stopped = "timeout"
            break
        ready, _, _ = select.select(open_pipes, [], [], min(left, 0.1))
        for pipe in ready:
            chunk = os.read(pipe.fileno(), 1 << 16)
            if not chunk:
                open_pipes.remove(pipe)
                continue
            out[pipe] += chunk
        if sum(len(b) for b in out.values()) > max_output:
            stopped = "output"
            break
    if stopped is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # bwrap and, through its PID namespace, everything inside
    code = proc.wait()
    seconds = time.monotonic() - start
    stdout, stderr = (bytes(out[pipe][:max_output]).decode("utf-8", "replace")
                      for pipe in (proc.stdout, proc.stderr))
    if code > 128:  # bwrap reports its program's death by signal N as 128 + N
        code = 128 - code
    if stopped == "timeout" and cap.hit(stderr):  # e.g. a thread bomb waiting on the threads it did start
        stopped = "processes"
    elif stopped is None:
        stopped = _reason(code, stderr, cap)
    killed = stopped in ("timeout", "output") or (stopped == "processes" and code == -signal.SIGKILL)
    return SandboxResult(stdout, stderr, None if killed else code, stopped, seconds)


def _reason(code: int, stderr: str, cap: _ProcessCap) -> str | None:
    """Why a program that ended on its own failed, when a limit or a crash explains it."""
    if code < 0:
        return {signal.SIGXCPU: "cpu", signal.SIGXFSZ: "file_size"}.get(-code, "signal")
    if code != 0 and cap.hit(stderr):
        return "processes"
    if code != 0 and "MemoryError" in stderr:
        return "memory"
    if code != 0 and "File too large" in stderr:
        return "file_size"
    return None
