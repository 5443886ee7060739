"""Running a program a model wrote, isolated from the trainer: ``run_python(code, ...)``.

Each program runs in its own process inside bubblewrap (``bwrap`` >= 0.5, Debian / Ubuntu package
``bubblewrap``): new user, PID, network, mount, IPC, UTS and cgroup namespaces, no nested user namespace
(bwrap >= 0.8), all capabilities dropped, a new session, an empty environment, a read-only view of the
Python installation and the system libraries, and three sized tmpfs mounts it may write: ``/scratch`` (its
working directory, holding ``main.py``), ``/tmp`` and ``/dev/shm``. Nothing of it touches the host's disk.

Limits for the whole program, not per process: a cgroup per run (:mod:`grpo_engine.cgroup`, v2 or v1)
bounds the memory of all its processes together, tmpfs files and memfds included, and the number of its
processes and threads. Where no cgroup can be made, a user who is not root gets per-process bounds
(``RLIMIT_AS``; ``RLIMIT_NPROC`` counted inside the run's own user namespace) and the result's ``limits``
says so; root, for whom ``RLIMIT_NPROC`` does not hold, is refused with the reason and the fix. Around
both: CPU seconds, file size, open files, no core dumps (``setrlimit``), and from here wall time, output
size and stdin, all under one timeout.

The stop reason is what the supervisor observed: the kernel's counts in the run's cgroup (out-of-memory
kills, refused forks, CPU time), the CPU time of the reaped processes, and the kills it sent itself;
never the program's output or its exit status. docs/sandbox.md lists each threat and its test.

Example:
    >>> # run_python("print(6 * 7)", timeout_s=5).stdout
    >>> # '42\\n'
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from grpo_engine import cgroup
from grpo_engine.seccomp import seccomp_fd, seccomp_filter
from grpo_engine.supervisor import Watch, supervise

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailable", "run_python", "sandbox_available"]


class SandboxUnavailable(RuntimeError):
    """The isolation the sandbox needs is not available on this machine (the message says what to do)."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Which bounds held for one run, and the most memory its whole program could hold under them.

    Attributes:
        memory: ``"cgroup v2"`` / ``"cgroup v1"``: one budget, ``memory_mb``, for every process and thread
            of the program, its tmpfs files, memfds and kernel memory; ``"rlimit"``: address space per
            process (``RLIMIT_AS`` = ``memory_mb``).
        processes: ``"cgroup v2"`` / ``"cgroup v1"`` (``pids.max``), or ``"rlimit"`` (``RLIMIT_NPROC``
            counted in the run's own user namespace, Linux >= 5.14; older kernels count every task of
            the user, so the program can start none).
        memory_bound_mb: the most the whole program can hold: ``memory_mb`` under a cgroup; under rlimits
            ``max_processes * memory_mb`` (address space) ``+ 3 * tmpfs_mb`` (the tmpfs mounts)
            ``+ max_processes * open_files * max_file_mb`` (unmapped memfds held open).
        max_processes: processes and threads allowed, the first one included.
        open_files: open files per process (``RLIMIT_NOFILE``).
        tmpfs_mb: the size of each of ``/scratch``, ``/tmp`` and ``/dev/shm`` (``memory_mb`` under a
            cgroup, which counts their pages; a third of it without).
        why: why no cgroup could be made ("" under one).
    """

    memory: str
    processes: str
    memory_bound_mb: int
    max_processes: int
    open_files: int
    tmpfs_mb: int
    why: str = ""


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What a program did.

    Attributes:
        stdout, stderr: its output, decoded as UTF-8 (bad bytes replaced), each cut at the output limit.
        exit_code: its exit status as bubblewrap reported it, -N for bwrap's 128 + N (death by signal N,
            or a program that exits with 128 + N: the status alone cannot tell); None when the sandbox
            killed it (``stopped`` says why).
        stopped: None when it ended on its own without hitting a limit, else the limit the supervisor saw
            it hit: ``"timeout"`` (wall time), ``"cpu"`` (CPU seconds), ``"memory"`` (the kernel killed
            a process of it at the memory limit), ``"output"`` (too much stdout + stderr),
            ``"processes"`` (a fork or thread refused at the process cap).
        seconds: wall time.
        limits: which bounds held (:class:`SandboxLimits`).
        memory_peak_mb: the most memory the whole program held, as its cgroup counted it (None without).
    """

    stdout: str
    stderr: str
    exit_code: int | None
    stopped: str | None
    seconds: float
    limits: SandboxLimits | None = None
    memory_peak_mb: float | None = None

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


def sandbox_available() -> str | None:
    """None when :func:`run_python` can run here, else why not (as root: also whether a cgroup can be
    made; one is made and removed to find out)."""
    why = _tools()
    if why is None and os.geteuid() == 0:
        group, why_not = _group(1 << 20, 1)
        if group is None:
            return _root_without_cgroup(why_not)
        group.remove()
    return why


def _tools() -> str | None:
    """Whether bubblewrap and prlimit are here and bubblewrap can create its namespaces."""
    if shutil.which("bwrap") is None:
        return ("bubblewrap is not installed (apt-get update && apt-get install bubblewrap, or dnf install "
                "bubblewrap)")
    if shutil.which("prlimit") is None:
        return "prlimit (util-linux) is not installed"
    try:
        seccomp_filter()  # a machine whose system calls the filter does not know: refuse (fail closed)
    except ValueError as error:
        return str(error)
    why, _ = _namespaces()
    return why


@functools.lru_cache(maxsize=1)
def _namespaces() -> tuple[str | None, tuple[int, ...]]:
    """Whether bwrap (>= 0.5, for sized tmpfs mounts) can create its namespaces here (a kernel or a
    container may forbid user namespaces), and its version."""
    env = {"PATH": "/usr/bin:/bin"}
    try:
        words = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, timeout=30,
                               env=env).stdout.split()
        version = tuple(int(p) for p in words[-1].split(".")) if words else ()
        probe = subprocess.run(["bwrap", "--unshare-all", "--ro-bind", "/", "/", "true"], capture_output=True,
                               text=True, timeout=30, env=env)
    except (OSError, ValueError, subprocess.TimeoutExpired) as error:
        return f"bubblewrap could not start ({error})", ()
    if probe.returncode != 0:
        return (f"bubblewrap cannot create its namespaces here ({probe.stderr.strip()[:200]}); enable "
                "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1)"), version
    if version < (0, 5):
        return f"bubblewrap {'.'.join(map(str, version))} is too old (>= 0.5 sizes tmpfs mounts)", version
    return None, version


def _group(memory_bytes: int, pids: int) -> tuple[cgroup.RunGroup | None, str]:
    try:
        return cgroup.make(memory_bytes, pids)
    except OSError as error:
        return None, f"making a cgroup failed ({error})"


def _root_without_cgroup(why: str) -> str:
    return (f"running as root, and no memory and pids cgroup can be made for the program: {why}. Root is "
            "exempt from RLIMIT_NPROC, so nothing would cap its processes; give the trainer a cgroup as "
            "above, or run it as a user who is not root (then per-process limits hold: docs/sandbox.md)")


def run_python(code: str, *, timeout_s: float = 10.0, memory_mb: int = 512, cpu_s: int | None = None,
               max_processes: int | None = None, max_output_bytes: int = 1 << 16, max_file_mb: int = 16,
               stdin: str = "") -> SandboxResult:
    """Runs ``code`` with this machine's Python (``-I -S``: the standard library only, no site-packages,
    no user paths, no environment variables read) in the sandbox.

    Args:
        code: the program's source (handed to bubblewrap through a memfd, never evaluated here).
        timeout_s: wall time before it is killed; stdin is written within it too.
        memory_mb: memory of the whole program under a cgroup (its tmpfs files included), else address
            space per process (``result.limits`` says which held).
        cpu_s: CPU seconds (default: ``timeout_s`` rounded up, plus 1, so that one busy process meets the
            wall limit first): of the whole program where its cgroup accounts them, and of each process
            (``RLIMIT_CPU``).
        max_processes: processes and threads together, the first one included (default 8 under a cgroup,
            1 without one, where each process's memory counts separately).
        max_output_bytes: stdout + stderr kept; past it the program is killed.
        max_file_mb: the largest file it may write (``RLIMIT_FSIZE``: a write past it fails with
            ``EFBIG``, which Python raises as ``OSError``; other programs get the kernel's SIGXFSZ).
        stdin: its standard input.

    Raises:
        SandboxUnavailable: no bubblewrap, or as root no cgroup (see :func:`sandbox_available`).
        ValueError: a limit that is not positive.
    """
    processes = 1 if max_processes is None else max_processes
    for name, value in (("timeout_s", timeout_s), ("memory_mb", memory_mb), ("max_processes", processes),
                        ("max_output_bytes", max_output_bytes), ("max_file_mb", max_file_mb)):
        if not value > 0:
            raise ValueError(f"run_python: {name}={value!r} must be > 0")
    why = _tools()
    if why is not None:
        raise SandboxUnavailable(f"run_python refuses to run: {why}")
    group, why_not = _group(memory_mb << 20, (max_processes or 8) + 2)  # + bwrap and its init
    if group is None and os.geteuid() == 0:
        raise SandboxUnavailable(f"run_python refuses to run: {_root_without_cgroup(why_not)}")
    limits = _limits(group, why_not, memory_mb, max_processes, max_file_mb)
    cpu = int(cpu_s if cpu_s is not None else -(-timeout_s // 1) + 1)
    source = -1
    try:
        source = os.memfd_create("main.py")
        os.write(source, code.encode("utf-8", "surrogatepass"))
        os.lseek(source, 0, os.SEEK_SET)
        # without a cgroup: RLIMIT_NPROC set inside the run's user namespace counts only its tasks (+ init)
        inner = [] if group else [shutil.which("prlimit"), f"--nproc={limits.max_processes + 1}", "--"]
        rlimits = ["prlimit", f"--cpu={cpu}:{cpu + 1}", f"--fsize={max_file_mb << 20}",
                   f"--nofile={limits.open_files}", "--core=0", "--msgqueue=0",
                   *([] if group else [f"--as={memory_mb << 20}"]), "--"]
        watch = Watch(timeout_s, max_output_bytes, cpu, group, limits.max_processes + 1)
        with seccomp_fd() as filters:  # grpo_engine.seccomp's program, read by bwrap from this fd
            cmd = _bwrap(source, limits.tmpfs_mb << 20, [*inner, str(_python()), "-I", "-S", "main.py"],
                         seccomp=filters)
            cmd = group.enter(rlimits + cmd) if group else rlimits + cmd
            seen = supervise(cmd, (source, filters), stdin.encode(), watch)
        return SandboxResult(**dataclasses.asdict(seen), limits=limits)
    finally:
        if source >= 0:
            os.close(source)
        if group is not None:
            group.kill()
            group.remove()


def _limits(group: cgroup.RunGroup | None, why: str, memory_mb: int, max_processes: int | None,
            max_file_mb: int) -> SandboxLimits:
    """The bounds of a run: under a cgroup one memory budget; without, each process's and the sum."""
    if group is not None:
        held = f"cgroup v{group.version}"
        return SandboxLimits(held, held, memory_mb, max_processes or 8, 64, memory_mb)
    processes, files, tmpfs = max_processes or 1, 16, max(1, memory_mb // 3)
    bound = processes * memory_mb + 3 * tmpfs + processes * files * max_file_mb
    return SandboxLimits("rlimit", "rlimit", bound, processes, files, tmpfs, why)


def _bwrap(source: int, tmpfs_bytes: int, program: list[str], seccomp: int | None = None) -> list[str]:
    """The bubblewrap command line: namespaces, read-only system views, sized tmpfs mounts, ``main.py``
    copied from the fd ``source``, then ``program`` run in ``/scratch``."""
    env = {"PATH": "/usr/bin:/bin", "HOME": "/scratch", "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = ["bwrap", "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
           "--cap-drop", "ALL", "--clearenv", *(arg for item in env.items() for arg in ("--setenv", *item)),
           *_binds(), "--proc", "/proc", "--dev", "/dev"]
    if _namespaces()[1] >= (0, 8):
        cmd.insert(2, "--disable-userns")  # no nested user namespace (the seccomp filter denies it too)
    for path in ("/scratch", "/tmp", "/dev/shm"):  # pages charged to the run's cgroup as they are written
        cmd += ["--size", str(tmpfs_bytes), "--tmpfs", path]
    cmd += ["--file", str(source), "/scratch/main.py", "--remount-ro", "/dev", "--remount-ro", "/"]
    if seccomp is not None:  # grpo_engine.seccomp's filter, read by bwrap from this fd and installed
        cmd += ["--seccomp", str(seccomp)]
    return cmd + ["--chdir", "/scratch", "--", *program]
