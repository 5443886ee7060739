"""The sandbox against hostile programs: each ends within its limit with a clear reason, and the process
that ran it (this test process, standing in for the trainer) is unharmed. Needs bubblewrap (CI installs
it); without it the sandbox refuses to run, which the last tests check."""

from __future__ import annotations

import os
import socket
import time

import pytest

from grpo_engine import sandbox
from grpo_engine.sandbox import SandboxUnavailable, run_python

needs_sandbox = pytest.mark.skipif(sandbox.sandbox_available() is not None,
                                   reason=f"no sandbox here: {sandbox.sandbox_available()}")


@needs_sandbox
def test_a_program_runs_and_returns_its_output():
    r = run_python("import sys\nprint(6 * 7)\nprint('to stderr', file=sys.stderr)\nsys.exit(3)", timeout_s=10)
    assert (r.stdout, r.stderr, r.exit_code, r.stopped) == ("42\n", "to stderr\n", 3, None)
    assert not r.ok and run_python("print(sum(range(10)))").ok


@needs_sandbox
@pytest.mark.parametrize("code,stopped", [
    ("while True:\n    pass", "timeout"),  # an infinite loop
    ("import os\nwhile True:\n    os.fork()", "processes"),  # a fork bomb
    ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", "processes"),
    ("import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(60,)).start()",
     "processes"),  # a thread bomb
    ("x = bytearray(10 * 2**30)", "memory"),  # a 10 GB allocation
    ("import sys\nfor _ in range(2**14):\n    sys.stdout.write('x' * 2**16)", "output"),  # 1 GB printed
    ("open('big', 'wb').write(b'x' * (64 << 20))", "file_size"),
    ("import ctypes\nctypes.string_at(0)", "signal"),  # a segfault through ctypes
])
def test_hostile_programs_end_within_their_limit_with_the_reason(code, stopped):
    start = time.monotonic()
    memory = 1024 if "threading" in code else 256  # room for 8 thread stacks: the process cap stops it
    r = run_python(code, timeout_s=3, memory_mb=memory, max_processes=8, max_output_bytes=1 << 16,
                   max_file_mb=8)
    assert r.stopped == stopped, (r.stopped, r.exit_code, r.stderr[-300:])
    assert time.monotonic() - start < 3 + 2  # within the wall limit, plus the kill and the clean-up
    assert len(r.stdout) + len(r.stderr) <= 2 * (1 << 16)
    if stopped == "signal":
        assert r.exit_code == -11  # SIGSEGV


@needs_sandbox
def test_the_cpu_limit_stops_a_busy_program_before_its_wall_time():
    r = run_python("while True:\n    pass", timeout_s=8, cpu_s=1)
    assert r.stopped == "cpu" and r.exit_code == -24 and r.seconds < 4  # SIGXCPU


@needs_sandbox
def test_it_cannot_write_outside_its_scratch_directory(tmp_path):
    target = tmp_path / "planted"
    code = (f"import os\nopen('mine.txt', 'w').write('ok')\nprint(os.listdir('.'))\n"
            f"for path in ({str(target)!r}, '/etc/planted', '/usr/planted', '/planted', '/tmp/planted'):\n"
            "    try:\n        open(path, 'w').write('x')\n        print('WROTE', path)\n"
            "    except OSError as e:\n        print('refused', path, e.errno)")
    r = run_python(code)
    assert "['main.py', 'mine.txt']" in r.stdout and "WROTE" not in r.stdout, r.stdout + r.stderr
    assert not target.exists() and not os.path.exists("/etc/planted")


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


def test_it_refuses_to_run_without_its_isolation(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match="bubblewrap is not installed"):
        run_python("print(1)")


def test_it_refuses_to_run_where_bubblewrap_cannot_create_namespaces(monkeypatch, tmp_path):
    fake = tmp_path / "bwrap"  # a bwrap that fails as it does where user namespaces are off
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: str(fake))
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setattr(sandbox, "_namespaces", sandbox._namespaces.__wrapped__)
    monkeypatch.setattr(sandbox.subprocess, "run", _with_path(sandbox.subprocess.run, str(tmp_path)))
    with pytest.raises(SandboxUnavailable, match="cannot create its namespaces here .*No permissions"):
        run_python("print(1)")


def _with_path(run, folder: str):
    """subprocess.run that finds programs in ``folder`` first (the sandbox passes its own PATH)."""
    def wrapped(cmd, *args, env=None, **kwargs):
        return run(cmd, *args, env={**(env or {}), "PATH": f"{folder}:/usr/bin:/bin"}, **kwargs)
    return wrapped


def test_as_root_it_refuses_to_run_without_a_process_cap(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: "/usr/bin/bwrap")
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0)
    monkeypatch.setattr(sandbox, "_PIDS_V1", tmp_path / "no-cgroup")
    with pytest.raises(SandboxUnavailable, match="number of processes cannot be capped"):
        run_python("print(1)")


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s=0 must be > 0"):
        run_python("print(1)", timeout_s=0)
