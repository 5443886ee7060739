"""The sandbox against hostile programs: each ends within its limit with the reason the supervisor saw, and
the process that ran it (this test process, standing in for the trainer) is unharmed.

Needs bubblewrap (CI installs it). Without it the sandbox refuses to run, which the refusal tests check
everywhere; the others skip, unless ``GRPO_REQUIRE_SANDBOX=1`` (set by .ci/run), which makes them fail.
A bomb runs only after the cap that stops it has been seen to hold on a bounded program (``capped``)."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_engine import cgroup, sandbox, seccomp, supervisor
from grpo_engine.sandbox import SandboxUnavailable, run_python

MISSING = sandbox.sandbox_available()
REQUIRED = os.environ.get("GRPO_REQUIRE_SANDBOX") == "1"
needs_sandbox = pytest.mark.skipif(MISSING is not None and not REQUIRED, reason=f"no sandbox here: {MISSING}")
ROOT = os.geteuid() == 0
UNIFIED = Path("/sys/fs/cgroup/unified")  # the hybrid layout's cgroup v2 mount

BOUNDED_FORKS = """import os, time
n = 0
for _ in range(50):
    try:
        if os.fork() == 0:
            time.sleep(1)
            os._exit(0)
        n += 1
    except OSError:
        pass
print(n)"""

FORK_BOMB = "import os\nwhile True:\n    os.fork()"
CAUGHT_FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
THREAD_BOMB = ("import threading, time\nwhile True:\n"
               "    threading.Thread(target=time.sleep, args=(60,)).start()")


@pytest.fixture(scope="module")
def capped():
    """The process cap holds on a program that stops by itself at 50 children, before any bomb runs."""
    r = run_python(BOUNDED_FORKS, timeout_s=5, max_processes=8)
    forked = int(r.stdout) if r.stdout.strip() else None  # 8 tasks: itself and 7 children
    assert (forked is not None and forked <= 7) or r.stopped == "processes", (r.stdout, r.stderr[-300:])


def under_a_cgroup(r: sandbox.SandboxResult) -> None:
    """Skips a test of the whole program's limits where no cgroup held (per-process bounds:
    test_as_a_user_who_is_not_root), unless CI requires the sandbox (then root has a cgroup or refuses)."""
    if not r.limits.memory.startswith("cgroup") and not REQUIRED:
        pytest.skip(f"no cgroup here, the bound that holds is per process: {r.limits.why}")


def test_the_sandbox_is_here_where_ci_requires_it():
    assert not (REQUIRED and MISSING), f"GRPO_REQUIRE_SANDBOX=1 but the sandbox cannot run here: {MISSING}"


@needs_sandbox
def test_a_program_runs_and_returns_its_output():
    r = run_python("import sys\nprint(6 * 7)\nprint('to stderr', file=sys.stderr)\nsys.exit(3)", timeout_s=10)
    assert (r.stdout, r.stderr, r.exit_code, r.stopped) == ("42\n", "to stderr\n", 3, None)
    assert not r.ok and run_python("print(sum(range(10)))").ok
    assert r.limits is not None and r.limits.memory == r.limits.processes
    if r.limits.memory.startswith("cgroup"):  # one budget for the whole program
        assert (r.limits.memory_bound_mb, r.limits.max_processes, r.limits.why) == (512, 8, "")
        assert 0 < r.memory_peak_mb <= 512


@needs_sandbox
@pytest.mark.parametrize("code,stopped", [
    ("while True:\n    pass", "timeout"),  # an infinite loop
    (FORK_BOMB, "processes"),
    (CAUGHT_FORK_BOMB, "processes"),
    (THREAD_BOMB, "processes"),
    ("x = bytearray(2**30)", "memory"),  # 1 GiB, touched
    ("import sys\nfor _ in range(2**14):\n    sys.stdout.write('x' * 2**16)", "output"),  # 1 GB printed
], ids=["loop", "fork_bomb", "fork_bomb_caught", "thread_bomb", "one_gib", "print_one_gb"])
def test_hostile_programs_end_within_their_limit_with_the_reason(code, stopped, capped):
    start = time.monotonic()
    r = run_python(code, timeout_s=3, memory_mb=256, max_processes=8, max_output_bytes=1 << 16, max_file_mb=8)
    under_a_cgroup(r)
    assert r.stopped == stopped, (r.stopped, r.exit_code, r.stderr[-300:])
    assert time.monotonic() - start < 3 + 2  # within the wall limit, plus the kill and the clean-up
    assert len(r.stdout) + len(r.stderr) <= 2 * (1 << 16)


# the attacks of issue 51: memory past memory_mb in places RLIMIT_AS never counted; each many files or
# memfds of 8 MiB (max_file_mb=8 holds for each)
SHM = "for i in range(96):\n    open(f'/dev/shm/f{i}', 'wb').write(b'x' * (8 << 20))\nprint('stored 768 MiB')"
MEMFDS = ("import os\nfds = []\nfor i in range(90):\n    fds.append(os.memfd_create(f'm{i}'))\n"
          "    os.write(fds[-1], b'x' * (8 << 20))\nprint('held 720 MiB')")
CHILDREN = ("import os, time\nfor i in range(6):\n    if os.fork() == 0:\n"
            "        block = bytearray(200 << 20)\n        time.sleep(30)\n        os._exit(0)\n"
            "for i in range(6):\n    os.wait()\nprint('held 1.2 GiB')")
SCRATCH = "for i in range(42):\n    open(f'f{i}', 'wb').write(b'x' * (8 << 20))\nprint('wrote 336 MiB')"


@needs_sandbox
@pytest.mark.parametrize("code", [SHM, MEMFDS, CHILDREN, SCRATCH],
                         ids=["dev_shm_768mib", "memfds_720mib", "six_children_1200mib", "scratch_336mib"])
def test_the_whole_program_holds_at_most_memory_mb(code):
    """768 MiB into /dev/shm, 720 MiB of memfds, six children of 200 MiB each, 336 MiB of files in
    /scratch: under memory_mb=256 each ends as ``memory``, killed by its cgroup's OOM killer (the peak it
    counted stays within the limit), not the host's; this process goes on."""
    r = run_python(code, timeout_s=10, memory_mb=256, max_file_mb=8, max_processes=8)
    under_a_cgroup(r)
    assert r.stopped == "memory" and "held" not in r.stdout and "wrote" not in r.stdout, r
    assert r.memory_peak_mb <= 256 and r.seconds < 5
    os.kill(os.getpid(), 0)


@needs_sandbox
def test_its_writable_places_are_sized_tmpfs_mounts_and_the_rest_is_read_only(tmp_path):
    target = tmp_path / "planted"
    code = ("import os\nopen('mine.txt', 'w').write('ok')\nprint(sorted(os.listdir('.')))\n"
            "print([os.statvfs(p).f_blocks * os.statvfs(p).f_frsize >> 20\n"
            "       for p in ('/scratch', '/tmp', '/dev/shm')])\n"
            f"for path in ({str(target)!r}, '/etc/planted', '/usr/planted', '/planted', '/dev/planted', "
            "'/tmp/planted', '/dev/shm/planted'):\n"
            "    try:\n        open(path, 'w').write('x')\n        print('WROTE', path)\n"
            "    except OSError as e:\n        print('refused', path, e.errno)")
    r = run_python(code, memory_mb=96)
    lines = r.stdout.splitlines()
    assert lines[0] == "['main.py', 'mine.txt']", r.stdout + r.stderr
    assert lines[1] == str([r.limits.tmpfs_mb] * 3)  # 96 each under a cgroup, 32 each without
    wrote = [line.split()[1] for line in lines if line.startswith("WROTE")]
    assert wrote == ["/tmp/planted", "/dev/shm/planted"]  # its own tmpfs mounts
    assert not target.exists() and not os.path.exists("/etc/planted") and not os.path.exists("/tmp/planted")


@needs_sandbox
def test_a_file_past_max_file_mb_fails_the_write():
    r = run_python("open('big', 'wb').write(b'x' * (64 << 20))", max_file_mb=8)
    assert (r.stopped, r.exit_code) == (None, 1) and "File too large" in r.stderr  # EFBIG: Python's OSError


@needs_sandbox
@pytest.mark.parametrize("code,exit_code", [
    ("import sys\nsys.exit(152)", -24),  # bwrap's status for SIGXCPU, read as "cpu" before issue 51
    ("import sys\nprint('MemoryError', file=sys.stderr)\nsys.exit(1)", 1),  # read as "memory"
    ("import sys\nprint('Killed: out of memory; BlockingIOError', file=sys.stderr)\nsys.exit(137)", -9),
    ("import ctypes\nctypes.string_at(0)", -11),  # a real segfault: a failure, not a limit
], ids=["exit_152", "memoryerror_on_stderr", "exit_137", "segfault"])
def test_what_a_program_prints_or_returns_is_never_a_stop_reason(code, exit_code):
    r = run_python(code, timeout_s=5)
    assert (r.stopped, r.exit_code, r.ok) == (None, exit_code, False), r


@needs_sandbox
def test_the_cpu_limit_stops_a_busy_program_before_its_wall_time():
    r = run_python("while True:\n    pass", timeout_s=8, cpu_s=1)
    assert r.stopped == "cpu" and r.seconds < 4


@needs_sandbox
@pytest.mark.parametrize("code", [
    "import time\ntime.sleep(60)",  # never reads its stdin: 4 MiB do not fit the pipe
    "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)",  # closes its output, then lives on
], ids=["stdin_never_read", "output_closed"])
def test_the_supervisor_cannot_be_stalled(code):
    start = time.monotonic()
    r = run_python(code, timeout_s=2, stdin="x" * (4 << 20))
    assert r.stopped == "timeout" and r.exit_code is None and time.monotonic() - start < 2 + 2


@needs_sandbox
def test_all_of_a_large_stdin_arrives():
    code = "import sys\ndata = sys.stdin.read()\nprint(len(data), data[-3:])"
    r = run_python(code, stdin="ab" * (1 << 21) + "end")
    assert r.ok and r.stdout == f"{(1 << 22) + 3} end\n"


@needs_sandbox
def test_it_sees_none_of_the_trainers_environment_or_files(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "secret-wandb-key")
    secret = tmp_path / "token.txt"
    secret.write_text("secret-file-content")
    code = ("import os, glob\nprint(sorted(os.environ))\nprint(open('/proc/1/environ').read())\n"
            f"print(os.path.exists({str(secret)!r}), os.path.exists(os.path.expanduser('~/.cache')))\n"
            f"print(glob.glob('/proc/*/environ'))")
    r = run_python(code)
    assert r.ok, r.stderr
    assert "secret" not in r.stdout and "WANDB" not in r.stdout
    lines = r.stdout.splitlines()
    assert lines[0] == "['HOME', 'LC_CTYPE', 'PATH', 'PWD', 'PYTHONDONTWRITEBYTECODE', 'TMPDIR']"
    assert lines[2] == "False False"


@needs_sandbox
def test_it_imports_the_standard_library_only():
    """``-I -S``: no site-packages on its path, so nothing installed for the trainer (numpy, torch, this
    package) is importable, while the standard library is."""
    r = run_python("import sys, json, importlib.util\n"
                   "print(json.dumps([sys.flags.no_site, sys.flags.isolated,"
                   " [p for p in sys.path if 'site' in p],"
                   " [m for m in ('numpy', 'torch', 'grpo_engine') if importlib.util.find_spec(m)]]))")
    assert r.ok, r.stderr
    assert json.loads(r.stdout) == [1, 1, [], []]

@needs_sandbox
def test_it_cannot_reach_a_port_on_the_host():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('IN')"
        r = run_python(code)
        assert "IN" not in r.stdout and r.exit_code == 1 and "ConnectionRefusedError" in r.stderr
        server.settimeout(0.2)
        with pytest.raises(socket.timeout):
            server.accept()  # nothing ever connected
    finally:
        server.close()


@needs_sandbox
def test_it_cannot_signal_the_process_that_runs_it_and_stdin_is_empty():
    code = ("import os, signal, sys\nprint(os.getppid())\n"
            "for pid in (os.getppid(), 1):\n    try:\n        os.kill(pid, signal.SIGKILL)\n"
            "    except OSError as e:\n        print('refused', e.errno)\n"
            "print(repr(sys.stdin.read()))\n"
            "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    r = run_python(code)
    assert r.ok, r.stderr
    lines = r.stdout.splitlines()
    # its own PID namespace holds bwrap's init and itself
    assert lines[0] == "1" and lines[-2] == "''" and lines[-1] == "[1, 2]"
    assert run_python("import sys; print(sys.stdin.read())", stdin="given").stdout == "given\n"
    os.kill(os.getpid(), 0)  # still here


@needs_sandbox
def test_it_cannot_create_a_nested_user_namespace():
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.unshare(0x10000000), ctypes.get_errno())")  # CLONE_NEWUSER
    r = run_python(code)
    assert r.ok and r.stdout.split() == ["-1", str(errno.EPERM)], r  # the seccomp filter's answer


@needs_sandbox
@pytest.mark.parametrize("call", ["bpf(9999, 0, 0)", "shmget(0, 4096, 0o1600)", "keyctl(9999, 0, 0, 0, 0)",
                                  "mount(b'none', b'/tmp', b'tmpfs', 0, 0)"])
def test_the_seccomp_filter_holds_inside_run_python(call):
    """The filter (grpo_engine.seccomp, tests/test_seccomp.py) is installed on every program run_python runs:
    each call of a denied family fails with EPERM."""
    name, args = call.split("(", 1)
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"NR = {seccomp.SYSCALL_NUMBERS[platform.machine()][name]}\n"
            f"args = [ctypes.c_long(a) if isinstance(a, int) else a for a in ({args[:-1]},)]\n"
            "print(libc.syscall(ctypes.c_long(NR), *args), ctypes.get_errno())")
    r = run_python(code)
    assert r.ok and r.stdout.split() == ["-1", str(errno.EPERM)], r


@needs_sandbox
def test_no_cgroup_is_left_behind():
    if not ROOT:
        pytest.skip("only root makes cgroups here")
    where = cgroup.layout()
    parents = {folder for name, folder in where.v1.items() if name in ("memory", "pids", "cpuacct")}
    parents |= {where.v2, where.v2.parent} if where.v2 is not None else set()
    before = {p for folder in parents for p in folder.glob(f"grpo-sandbox-{os.getpid()}-*")}
    run_python("print(1)")
    run_python("while True:\n    pass", timeout_s=1)
    run_python("x = bytearray(2**30)", memory_mb=128)
    assert {p for folder in parents for p in folder.glob(f"grpo-sandbox-{os.getpid()}-*")} == before


# -- where the limits come from: root with cgroup v1 (above), cgroup v2 (a fake cgroupfs and the real
# unified mount), a user who is not root (rlimits), and the refusals


def fake_v2(tmp: Path, own_enables: str, parent_enables: str) -> cgroup.Layout:
    """A cgroup v2 tree in plain folders: the mount, and this process's cgroup ``trainer`` below it."""
    (tmp / "trainer").mkdir(parents=True)
    for folder, enables in ((tmp, parent_enables), (tmp / "trainer", own_enables)):
        (folder / "cgroup.controllers").write_text("cpu io memory pids\n")
        (folder / "cgroup.subtree_control").write_text(enables + "\n")
        (folder / "cgroup.procs").write_text("")
    return cgroup.Layout(v2=tmp / "trainer", v2_mount=tmp, v1={})


def test_cgroup_v2_file_protocol_on_a_fake_cgroupfs(tmp_path):
    group, why = cgroup.make(256 << 20, 10, fake_v2(tmp_path, "", "memory pids"))
    assert why == "" and group.version == 2
    folder = group.folders["memory"]
    assert folder.parent == tmp_path and folder.name.startswith(f"grpo-sandbox-{os.getpid()}-")  # beside it
    written = {"memory.max": str(256 << 20), "memory.swap.max": "0", "memory.oom.group": "1",
               "pids.max": "10"}
    assert {name: (folder / name).read_text() for name in written} == written
    (folder / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\noom_group_kill 1\n")
    (folder / "pids.events").write_text("max 5\n")
    (folder / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\n")
    (folder / "memory.peak").write_text(str(200 << 20))
    assert group.events() == cgroup.Events(oom_kills=2, pids_max=5, cpu_s=1.5, peak_bytes=200 << 20)
    # the shell that starts bwrap enters the group first: its pid lands in the one cgroup.procs
    subprocess.run(group.enter(["true"]), check=True)
    assert (folder / "cgroup.procs").read_text().strip().isdigit()
    own_group, _ = cgroup.make(1 << 20, 1, fake_v2(tmp_path / "root", "memory pids", ""))
    assert own_group.folders["pids"].parent == tmp_path / "root" / "trainer"  # below it where it enables them


def test_where_this_process_sits_is_read_from_mountinfo_and_its_cgroup_file():
    mountinfo = ("31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
                 "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
                 "35 31 0:32 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
                 "39 31 0:36 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n"
                 "41 31 0:38 / /sys/fs/cgroup/unified\\040v2 rw - cgroup2 cgroup2 rw\n")
    cgroups = "0::/user.slice/trainer\n4:memory:/docker/abc/job\n8:pids:/\n2:cpu,cpuacct:/x\n"
    assert cgroup.read_layout(mountinfo, cgroups) == cgroup.Layout(
        v2=Path("/sys/fs/cgroup/unified v2/user.slice/trainer"), v2_mount=Path("/sys/fs/cgroup/unified v2"),
        v1={"cpu": Path("/sys/fs/cgroup/cpu,cpuacct/x"), "cpuacct": Path("/sys/fs/cgroup/cpu,cpuacct/x"),
            "memory": Path("/sys/fs/cgroup/memory/job"), "pids": Path("/sys/fs/cgroup/pids")})


def test_what_the_supervisor_counts_decides_the_stop_reason():
    events = cgroup.Events(oom_kills=0, pids_max=0, cpu_s=3.0)
    watch = supervisor.Watch(10, 1 << 16, 2, group=None, task_cap=9)
    assert supervisor.reason(None, 0, events, False, cpu_spent=True) is None  # ended well: not a stop
    assert supervisor.reason(None, 1, events, False, cpu_spent=True) == "cpu"
    assert supervisor.reason("timeout", 0, dataclasses.replace(events, oom_kills=1), False, False) == "memory"
    assert supervisor.reason(None, 0, dataclasses.replace(events, pids_max=3), False, False) == "processes"
    assert supervisor.reason("timeout", 0, events, True, False) == "processes"  # rlimit: at the cap, killed
    assert supervisor.reason(None, -24, events, False, False) is None  # a status is not a stop

    class Counted:
        def events(self):
            return events
    assert supervisor.limit_hit(dataclasses.replace(watch, group=Counted())) == "cpu"  # the whole program's


def test_root_on_cgroup_v2_without_a_usable_cgroup_refuses_with_the_reason_and_the_fix(monkeypatch, tmp_path):
    """The usual GPU container: root, cgroup v2, and its processes in the root cgroup of its namespace."""
    layout = fake_v2(tmp_path, "", "")
    layout = dataclasses.replace(layout, v2=tmp_path, v2_mount=tmp_path)
    (tmp_path / "cgroup.procs").write_text("1\n7\n")
    group, why = cgroup.make(1 << 20, 1, layout)
    assert group is None
    assert f"cgroup {tmp_path} (writable) enables nothing for its children" in why
    assert "mkdir /sys/fs/cgroup/init" in why and "systemd-run --scope -p Delegate=yes" in why
    monkeypatch.setattr(cgroup, "layout", lambda: layout)
    monkeypatch.setattr(sandbox, "_tools", lambda: None)
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0)
    with pytest.raises(SandboxUnavailable, match="running as root, and no memory and pids cgroup .*Fix: "):
        run_python("print(1)")
    assert sandbox.sandbox_available().startswith("running as root, and no memory and pids cgroup can be")


@pytest.mark.skipif(not (ROOT and UNIFIED.is_dir()), reason=f"needs root and a cgroup v2 mount at {UNIFIED}")
def test_the_real_cgroup_v2_mount_here(tmp_path):
    """This machine's unified hierarchy holds no memory or pids controller (both are v1's): the exact
    reason; its core files still work for a run's folder: joining, CPU time, killing, removing."""
    layout = cgroup.Layout(v2=UNIFIED, v2_mount=UNIFIED, v1={})
    controllers = set((UNIFIED / "cgroup.controllers").read_text().split())
    if {"memory", "pids"} <= controllers:
        group, why = cgroup.make(64 << 20, 4, layout)
        assert why == "" and group is not None and group.remove()
        return
    assert cgroup.make(64 << 20, 4, layout) == (None, f"cgroup v2 ({UNIFIED}): memory and pids are not among "
                                                        "its controllers (they are bound to cgroup v1)")
    folder = UNIFIED / f"grpo-sandbox-{os.getpid()}-test"
    folder.mkdir()
    group = cgroup.RunGroup(2, {"memory": folder, "pids": folder})
    try:
        busy = subprocess.Popen(group.enter([sys.executable, "-c", "while True: pass"]))
        time.sleep(1.0)
        assert int((folder / "cgroup.procs").read_text()) == busy.pid
        assert group.events().cpu_s > 0.3
        group.kill()
        assert busy.wait(timeout=5) == -9
    finally:
        assert group.remove()


@pytest.mark.skipif(not (ROOT and shutil.which("setpriv") and Path("/usr/bin/python3").exists()),
                    reason="needs root (to become another user), setpriv and /usr/bin/python3")
def test_as_a_user_who_is_not_root():
    """As ``nobody`` no cgroup here can be written: per-process bounds hold, and say so. The process cap
    (RLIMIT_NPROC inside the run's own user namespace) is seen to hold before the bombs run; memory is
    bounded per process (the stated bound), the tmpfs mounts by their size, open files by their number."""
    if MISSING is not None:
        pytest.skip(MISSING)
    package = str(Path(sandbox.__file__).parent)
    as_nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    if subprocess.run([*as_nobody, "test", "-r", f"{package}/sandbox.py"]).returncode != 0:
        pytest.skip(f"nobody cannot read {package}")
    programs = {"package": package, "bounded": BOUNDED_FORKS, "shm": SHM, "memfds": MEMFDS,
                "fork_bomb": FORK_BOMB, "fork_bomb_caught": CAUGHT_FORK_BOMB, "thread_bomb": THREAD_BOMB}
    env = {"PATH": "/usr/bin:/bin", "PROGRAMS": json.dumps(programs)}
    done = subprocess.run([*as_nobody, "/usr/bin/python3", "-"], input=AS_USER, capture_output=True,
                          text=True, timeout=120, cwd="/", env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    if seen["limits"]["memory"] != "rlimit":
        pytest.skip(f"this machine gives nobody a cgroup: {seen['limits']}")
    assert seen["limits"]["max_processes"] == 1 and seen["limits"]["memory_bound_mb"] == 512 + 510 + 256
    assert seen["bounded"] == "7"  # max_processes=8: itself and 7 children
    assert seen["fork_bomb"] in ([None, 1], ["processes", None])  # it dies of its refused fork, or is capped
    assert seen["fork_bomb_caught"] == ["processes", None] and seen["thread_bomb"] == ["processes", None]
    assert seen["dev_shm"][0] is None and "No space left on device" in seen["dev_shm"][2]
    assert seen["memfds"][0] is None and "Too many open files" in seen["memfds"][2]
    assert seen["10_gib"] == [None, 1, "MemoryError"]  # RLIMIT_AS; the program's error, not a stop reason


AS_USER = """import json, os, sys, types
programs = json.loads(os.environ["PROGRAMS"])
package = types.ModuleType("grpo_engine")  # the sandbox alone (the package's __init__ imports torch)
package.__path__ = [programs["package"]]
sys.modules["grpo_engine"] = package
from grpo_engine.sandbox import run_python

def seen(code, **limits):
    r = run_python(code, timeout_s=3, max_file_mb=8, **limits)
    return [r.stopped, r.exit_code, r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""]

out = {"limits": run_python("pass").limits.__dict__}
out["bounded"] = run_python(programs["bounded"], timeout_s=5, max_processes=8).stdout.strip()
if out["bounded"] == "7":  # the cap holds: the bombs may run
    out["fork_bomb"] = seen(programs["fork_bomb"], max_processes=8)[:2]
    out["fork_bomb_caught"] = seen(programs["fork_bomb_caught"], max_processes=8)[:2]
    out["thread_bomb"] = seen(programs["thread_bomb"], max_processes=8, memory_mb=1024)[:2]
out["dev_shm"] = seen(programs["shm"], memory_mb=256)
out["memfds"] = seen(programs["memfds"], memory_mb=256)
out["10_gib"] = seen("x = bytearray(10 * 2**30)", memory_mb=256)
out["10_gib"][2] = out["10_gib"][2].split(":")[0]
print(json.dumps(out))
"""


def test_it_refuses_to_run_without_its_isolation(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match="bubblewrap is not installed"):
        run_python("print(1)")


def test_it_refuses_to_run_where_bubblewrap_cannot_create_namespaces(monkeypatch, tmp_path):
    fake = tmp_path / "bwrap"  # a bwrap that fails as it does where user namespaces are off
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'bubblewrap 0.8.0' && exit 0\n"
                    "echo 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: str(fake))
    monkeypatch.setattr(sandbox, "_namespaces", sandbox._namespaces.__wrapped__)
    monkeypatch.setattr(sandbox.subprocess, "run", _with_path(sandbox.subprocess.run, str(tmp_path)))
    with pytest.raises(SandboxUnavailable, match="cannot create its namespaces here .*No permissions"):
        run_python("print(1)")


def _with_path(run, folder: str):
    """subprocess.run that finds programs in ``folder`` first (the sandbox passes its own PATH)."""
    def wrapped(cmd, *args, env=None, **kwargs):
        return run(cmd, *args, env={**(env or {}), "PATH": f"{folder}:/usr/bin:/bin"}, **kwargs)
    return wrapped


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s=0 must be > 0"):
        run_python("print(1)", timeout_s=0)
    with pytest.raises(ValueError, match="max_processes=0 must be > 0"):
        run_python("print(1)", max_processes=0)
