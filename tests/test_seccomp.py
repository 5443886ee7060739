"""The sandbox's seccomp filter (grpo_engine/seccomp.py), two ways.

1. On the program itself: a small classic-BPF interpreter written here runs it on (arch, nr, args) and
   shows each denied call gets its errno, everything else is allowed, a foreign arch and the x32 ABI are
   killed; the syscall numbers are checked against this machine's kernel headers.
2. In the kernel: the real bwrap installs it (``--seccomp FD``) in front of this machine's Python, and
   each family of calls fails inside with the errno, while the same calls reach the kernel without it,
   and a normal program (threads, subprocess, mmap, memfd, multiprocessing) runs. Skipped only where
   bwrap is not installed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_engine import seccomp
from grpo_engine.seccomp import ARCHES, seccomp_fd, seccomp_filter

EPERM, ENOSYS = errno.EPERM, errno.ENOSYS
KILL, ALLOW = 0x80000000, 0x7FFF0000
AUDIT_ARCH_I386, AUDIT_ARCH_ARM = 0x40000003, 0x40000028


# ---- a classic-BPF interpreter for seccomp programs (the subset the kernel's seccomp checker accepts) ----

def run_bpf(program: bytes, arch: int, nr: int, args: tuple[int, ...] = ()) -> int:
    """The action ``program`` returns for one call: ``struct seccomp_data`` built here, every instruction
    decoded and checked (aligned loads inside seccomp_data, jumps inside the program, ends in a return)."""
    assert len(program) % 8 == 0 and 0 < len(program) // 8 <= 4096
    ops = [struct.unpack_from("=HBBI", program, i) for i in range(0, len(program), 8)]
    args = tuple(args) + (0,) * (6 - len(args))
    data = struct.pack("<iIQ6Q", nr, arch, 0, *(a & (2**64 - 1) for a in args))
    acc, pc = 0, 0
    while True:
        assert 0 <= pc < len(ops), f"fell off the program at {pc}"
        code, jt, jf, k = ops[pc]
        if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            assert k % 4 == 0 and k + 4 <= len(data), k
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x06:  # BPF_RET | BPF_K
            return k
        elif code in (0x15, 0x25, 0x35, 0x45):  # BPF_JMP | JEQ / JGT / JGE / JSET | BPF_K
            taken = {0x15: acc == k, 0x25: acc > k, 0x35: acc >= k, 0x45: acc & k != 0}[code]
            pc += jt if taken else jf
        elif code == 0x05:  # BPF_JMP | BPF_JA
            pc += k
        else:
            raise AssertionError(f"opcode {code:#x} at {pc} is not one this interpreter (or the test) knows")
        pc += 1


def outcome(action: int) -> str | int:
    """``"allow"``, ``"kill"``, or the errno an ERRNO action returns."""
    if action == ALLOW:
        return "allow"
    if action == KILL:
        return "kill"
    assert action & 0xFFFF0000 == 0x00050000, hex(action)  # SECCOMP_RET_ERRNO
    return action & 0xFFFF


def verdict(arch: str, name_or_nr: str | int, *args: int) -> str | int:
    nr = name_or_nr if isinstance(name_or_nr, int) else seccomp.SYSCALL_NUMBERS[arch][name_or_nr]
    return outcome(run_bpf(seccomp_filter(arch), ARCHES[arch], nr, args))


# What a sandbox must refuse, written here independently of the module's table: name -> errno.
MUST_DENY = {
    "namespaces": {"unshare": EPERM, "setns": EPERM, "clone3": ENOSYS},
    "mounts": {name: EPERM for name in ("mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree",
                                         "open_tree_attr", "fsopen", "fsmount", "fsconfig", "fspick",
                                         "mount_setattr")},
    "kernel programs": {"bpf": EPERM, "io_uring_setup": ENOSYS, "io_uring_enter": ENOSYS,
                        "io_uring_register": ENOSYS, "perf_event_open": EPERM, "userfaultfd": EPERM},
    "other processes": {"ptrace": EPERM, "process_vm_readv": EPERM, "process_vm_writev": EPERM, "kcmp": EPERM,
                        "pidfd_getfd": EPERM},
    "keyring": {"keyctl": EPERM, "add_key": EPERM, "request_key": EPERM},
    "System V IPC": {"shmget": EPERM, "semget": EPERM, "msgget": EPERM},
    "kernel and machine": {name: EPERM for name in (
        "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon",
        "swapoff", "acct", "quotactl", "lookup_dcookie", "syslog", "open_by_handle_at", "name_to_handle_at")},
}
# x86-64 only (these calls do not exist on aarch64)
MUST_DENY_X86 = {"iopl": EPERM, "ioperm": EPERM, "modify_ldt": EPERM, "uselib": EPERM}

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x2000000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
THREAD_FLAGS = 0x3D0F00  # VM|FS|FILES|SIGHAND|THREAD|SYSVSEM|SETTLS|PARENT_SETTID|CHILD_CLEARTID (glibc)
FORK_FLAGS = 0x01200011  # CHILD_SETTID|CHILD_CLEARTID|SIGCHLD (glibc's fork)
VFORK_FLAGS = 0x4111  # VM|VFORK|SIGCHLD (posix_spawn)


def test_the_program_is_whole_records_and_starts_with_the_arch_check():
    for arch, audit in ARCHES.items():
        program = seccomp_filter(arch)
        ops = [struct.unpack_from("=HBBI", program, i) for i in range(0, len(program), 8)]
        # ld arch; jeq AUDIT_ARCH, +1; ret KILL_PROCESS; ld nr
        assert ops[:4] == [(0x20, 0, 0, 4), (0x15, 1, 0, audit), (0x06, 0, 0, KILL), (0x20, 0, 0, 0)]
        assert ops[-1] == (0x06, 0, 0, ALLOW)
        # the layout: prologue (+ x32 check), two instructions per denied call, 26 for the four argument rules
        numbers = seccomp.SYSCALL_NUMBERS[arch]
        denied = sum(name in numbers for name in seccomp.DENIED)
        assert len(ops) == 4 + 2 * (arch == "x86_64") + 2 * denied + 26 + 1
        assert seccomp_filter(arch) is program  # built once


def test_aliases_and_this_machine():
    assert seccomp_filter("amd64") == seccomp_filter("x86_64")
    assert seccomp_filter("ARM64") == seccomp_filter("aarch64")
    if platform.machine() in ("x86_64", "aarch64"):
        assert seccomp_filter() == seccomp_filter(platform.machine())
    with pytest.raises(ValueError, match="riscv64.*known: x86_64, aarch64"):
        seccomp_filter("riscv64")


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("family", MUST_DENY)
def test_each_denied_call_returns_its_errno(arch, family):
    got = {name: verdict(arch, name) for name in MUST_DENY[family]}
    assert got == MUST_DENY[family]
    if arch == "x86_64":
        assert {name: verdict(arch, name) for name in MUST_DENY_X86} == MUST_DENY_X86


@pytest.mark.parametrize("arch", ARCHES)
def test_every_other_call_is_allowed(arch):
    """Every number below 1024 not denied (with zero arguments) is allowed: the filter is a deny list."""
    numbers = seccomp.SYSCALL_NUMBERS[arch]
    denied = {numbers[name] for name in seccomp.DENIED if name in numbers}
    for nr in range(1024):
        expected = seccomp.DENIED[_name(arch, nr)] if nr in denied else "allow"
        assert verdict(arch, nr) == expected, nr
    # what CPython and its test-style programs use, by number (x86-64 / aarch64 tables)
    used = {"x86_64": {"read": 0, "write": 1, "mmap": 9, "vfork": 58, "execve": 59, "wait4": 61, "futex": 202,
                       "openat": 257, "seccomp": 317, "memfd_create": 319, "getrandom": 318, "rseq": 334},
            "aarch64": {"read": 63, "write": 64, "mmap": 222, "execve": 221, "wait4": 260, "futex": 98,
                        "openat": 56, "seccomp": 277, "memfd_create": 279, "getrandom": 278, "rseq": 293}}
    assert {name: verdict(arch, nr) for name, nr in used[arch].items()} == dict.fromkeys(used[arch], "allow")


def _name(arch: str, nr: int) -> str:
    numbers = seccomp.SYSCALL_NUMBERS[arch]
    return next(name for name, n in numbers.items() if n == nr and name in seccomp.DENIED)


@pytest.mark.parametrize("arch", ARCHES)
def test_clone_is_refused_with_a_namespace_flag_and_allowed_for_threads_and_processes(arch):
    for flags in (THREAD_FLAGS, FORK_FLAGS, VFORK_FLAGS, 17):
        assert verdict(arch, "clone", flags) == "allow", hex(flags)
    for flag in (CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID,
                 CLONE_NEWNET):
        assert verdict(arch, "clone", FORK_FLAGS | flag) == EPERM, hex(flag)
        assert verdict(arch, "clone", (0xFFFF << 32) | flag | 17) == EPERM  # high bits change nothing
    assert verdict(arch, "clone3", 0, 88) == ENOSYS  # flags behind a pointer: glibc falls back to clone


@pytest.mark.parametrize("arch", ARCHES)
def test_argument_rules_compare_the_32_bits_the_kernel_reads(arch):
    tiocsti, tioclinux, fionread = 0x5412, 0x541C, 0x541B
    assert verdict(arch, "ioctl", 0, tiocsti) == EPERM
    assert verdict(arch, "ioctl", 0, (1 << 32) | tiocsti) == EPERM  # the kernel reads cmd as unsigned int
    assert verdict(arch, "ioctl", 0, tioclinux) == EPERM
    assert verdict(arch, "ioctl", 0, fionread) == "allow"
    assert verdict(arch, "ioctl", 0, 0x5401) == "allow"  # TCGETS: isatty()
    for persona in (0, 8, 0x20000, 0x20008, 0xFFFFFFFF):
        assert verdict(arch, "personality", persona) == "allow", hex(persona)
    for persona in (0x0040000, 0x0400000, 0x0040008):  # ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC
        assert verdict(arch, "personality", persona) == EPERM, hex(persona)
    assert verdict(arch, "socket", 40, 1, 0) == EPERM  # AF_VSOCK: not isolated by a network namespace
    assert verdict(arch, "socket", 38, 5, 0) == EPERM  # AF_ALG
    for family in (1, 2, 10, 16):  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK
        assert verdict(arch, "socket", family, 1, 0) == "allow"


@pytest.mark.parametrize("arch", ARCHES)
def test_a_foreign_architecture_is_killed(arch):
    program = seccomp_filter(arch)
    other = next(a for a in ARCHES if a != arch)
    for audit in (AUDIT_ARCH_I386, AUDIT_ARCH_ARM, ARCHES[other], 0, 0xFFFFFFFF):
        for nr in (0, 39, 272):
            assert outcome(run_bpf(program, audit, nr)) == "kill", (hex(audit), nr)


def test_the_x32_abi_is_killed_on_x86_64():
    x32 = 0x40000000
    for nr in (0, 39, 56, 272, 0x1FF, 0x3FFFFFFF):  # getpid, clone, unshare: none may slip past the table
        assert verdict("x86_64", x32 | nr) == "kill"
    assert verdict("x86_64", -1) == "kill"  # 0xffffffff as unsigned
    assert verdict("x86_64", x32 - 1) == "allow"


def _header(*candidates: str) -> dict[str, int]:
    for path in map(Path, candidates):
        if path.is_file():
            return {m[1]: int(m[2]) for m in re.finditer(r"#define __NR_(\w+)\s+(\d+)\b", path.read_text())}
    pytest.skip(f"no kernel headers here ({candidates[0]}): apt install linux-libc-dev")


@pytest.mark.parametrize("arch,headers", [
    ("x86_64", ("/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "/usr/include/asm/unistd_64.h")),
    ("aarch64", ("/usr/include/asm-generic/unistd.h",)),
])
def test_syscall_numbers_match_the_kernel_headers(arch, headers):
    defined = _header(*headers)
    table = seccomp.SYSCALL_NUMBERS[arch]
    checked = {name: nr for name, nr in table.items() if name in defined}
    assert checked == {name: defined[name] for name in checked}
    assert len(checked) >= len(table) - 3, set(table) - set(checked)
    # newer than many headers: syscall_64.tbl / the generic table of Linux 6.8 and 6.15
    newer = {"statmount": 457, "listmount": 458, "open_tree_attr": 467}
    assert {name: table[name] for name in newer} == newer


# ---- the descriptor ----

def test_the_descriptor_holds_the_program_sealed_and_is_closed_after():
    with seccomp_fd("x86_64") as fd:
        assert not os.get_inheritable(fd)  # only the child it is passed to (pass_fds) gets it
        data = b""
        while chunk := os.read(fd, 4096):
            data += chunk
        assert data == seccomp_filter("x86_64")
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)  # sealed
        os.lseek(fd, 0, os.SEEK_SET)
    with pytest.raises(OSError):
        os.fstat(fd)


def test_without_memfd_a_pipe_carries_the_program(monkeypatch):
    def refuse(*args):
        raise OSError(errno.ENOSYS, "memfd_create")

    monkeypatch.setattr(os, "memfd_create", refuse)
    with seccomp_fd("aarch64") as fd:
        data = b""
        while chunk := os.read(fd, 4096):
            data += chunk
        assert data == seccomp_filter("aarch64")
    with pytest.raises(OSError):
        os.fstat(fd)


# ---- in the kernel, under the real bwrap ----

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
PYTHON = os.path.realpath(sys.executable)  # the real interpreter (a venv's python is a link to it)
# The numbers the programs below call, written here (x86-64: syscall_64.tbl; aarch64: asm-generic/unistd.h)
NR = {"x86_64": {"unshare": 272, "clone": 56, "clone3": 435, "setns": 308, "mount": 165, "umount2": 166,
                 "ptrace": 101, "process_vm_readv": 310, "bpf": 321, "io_uring_setup": 425, "keyctl": 250,
                 "perf_event_open": 298, "userfaultfd": 323, "open_by_handle_at": 304, "ioctl": 16,
                 "personality": 135, "socket": 41, "shmget": 29, "msgget": 68},
      "aarch64": {"unshare": 97, "clone": 220, "clone3": 435, "setns": 268, "mount": 40, "umount2": 39,
                  "ptrace": 117, "process_vm_readv": 270, "bpf": 280, "io_uring_setup": 425, "keyctl": 219,
                  "perf_event_open": 241, "userfaultfd": 282, "open_by_handle_at": 265, "ioctl": 29,
                  "personality": 92, "socket": 198, "shmget": 194, "msgget": 186}}

# name: (the call made inside, the errno the filter gives, whether the call without the filter surely gets
# another answer on any kernel: not for calls a kernel or container policy may refuse by itself)
CALLS = {
    "unshare(CLONE_NEWUSER)": ("unshare_newuser()", EPERM, False),
    "clone(CLONE_NEWUSER)": ("clone_newuser()", EPERM, False),
    "clone3": ("call('clone3', None, 0)", ENOSYS, True),
    "setns": ("call('setns', -1, 0)", EPERM, True),
    "mount": ("call('mount', b'none', b'/no-such-target', b'tmpfs', 0, None)", EPERM, True),
    "umount2": ("call('umount2', b'/no-such-target', 0)", EPERM, True),
    "ptrace(PTRACE_TRACEME)": ("call('ptrace', 0, 0, 0, 0)", EPERM, False),
    "process_vm_readv": ("call('process_vm_readv', os.getpid(), None, 0, None, 0, 0)", EPERM, True),
    "bpf": ("call('bpf', 9999, None, 0)", EPERM, False),
    "io_uring_setup": ("call('io_uring_setup', 1, None)", ENOSYS, True),
    "keyctl": ("call('keyctl', 9999, 0, 0, 0, 0)", EPERM, True),
    "perf_event_open": ("call('perf_event_open', None, 0, -1, -1, 0)", EPERM, True),
    "userfaultfd": ("call('userfaultfd', 0)", EPERM, False),
    "open_by_handle_at": ("call('open_by_handle_at', -1, None, 0)", EPERM, False),
    "ioctl(TIOCSTI)": ("call('ioctl', 1, 0x5412, b'x')", EPERM, True),
    "personality(ADDR_NO_RANDOMIZE)": ("call('personality', 0x0040000)", EPERM, False),
    "socket(AF_VSOCK)": ("call('socket', 40, 1, 0)", EPERM, True),
    "shmget(IPC_PRIVATE)": ("call('shmget', 0, 4096, 0o1600)", EPERM, True),
    "msgget(IPC_PRIVATE)": ("call('msgget', 0, 0o1600)", EPERM, True),
}

PROBE = """
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = json.loads(sys.argv[1])

def call(name, *args):  # 0, or the errno
    ctypes.set_errno(0)
    args = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    return 0 if libc.syscall(ctypes.c_long(NR[name]), *args) != -1 else ctypes.get_errno()

def unshare_newuser():
    if hasattr(os, "unshare"):  # Python 3.12+
        try:
            os.unshare(os.CLONE_NEWUSER)
        except OSError as error:
            return error.errno
        return 0
    return call("unshare", 0x10000000)

def clone_newuser():  # a fork in a new user namespace, made raw: the child leaves at once
    ctypes.set_errno(0)
    pid = libc.syscall(ctypes.c_long(NR["clone"]), ctypes.c_long(0x10000000 | 17), *[ctypes.c_long(0)] * 4)
    if pid == 0:
        os._exit(0)
    if pid > 0:
        os.waitpid(pid, 0)
        return 0
    return ctypes.get_errno()

print(json.dumps({name: eval(expr) for name, expr in json.loads(sys.argv[2]).items()}))
"""


def sandboxed(code: str, *argv: str, filtered: bool = True) -> subprocess.CompletedProcess:
    """``code`` run by this machine's Python under bwrap, with the filter or without it."""
    cmd = ["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc",
           "--dev", "/dev"]
    with contextlib.ExitStack() as stack:
        fds: tuple[int, ...] = ()
        if filtered:
            fds = (stack.enter_context(seccomp_fd()),)
            cmd += ["--seccomp", str(fds[0])]
        return subprocess.run([*cmd, "--", PYTHON, "-I", "-c", code, *argv], pass_fds=fds,
                              capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})


@pytest.fixture(scope="module")
def answers() -> dict[str, dict[str, int]]:
    """Each call's errno inside bwrap, with and without the filter (one program each way)."""
    if platform.machine() not in NR:
        pytest.skip(f"no syscall numbers for {platform.machine()} in this test")
    calls = {name: expr for name, (expr, _, _) in CALLS.items()}
    argv = (json.dumps(NR[platform.machine()]), json.dumps(calls))
    found = {}
    for way in (True, False):
        run = sandboxed(PROBE, *argv, filtered=way)
        assert run.returncode == 0, run.stderr[-2000:]
        found["filtered" if way else "bare"] = json.loads(run.stdout)
    return found


@needs_bwrap
@pytest.mark.parametrize("name", CALLS)
def test_in_the_kernel_each_family_fails_with_its_errno(name, answers):
    _, expected, differs = CALLS[name]
    assert answers["filtered"][name] == expected, (os.strerror(answers["filtered"][name]), answers)
    if differs:  # it is the filter that refuses: without it, the same call reached the kernel
        assert answers["bare"][name] != expected, answers["bare"]


@needs_bwrap
def test_a_nested_bwrap_fails_under_the_filter():
    code = ("import subprocess\n"
            "r = subprocess.run(['bwrap', '--unshare-all', '--ro-bind', '/', '/', 'true'],\n"
            "                   capture_output=True, text=True)\n"
            "print(r.returncode, r.stderr.strip())")
    run = sandboxed(code)
    assert run.returncode == 0, run.stderr
    status, _, message = run.stdout.partition(" ")
    assert status != "0" and "create new namespace" in message, run.stdout  # its unshare got EPERM


@needs_bwrap
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the x32 ABI is x86-64's")
def test_an_x32_call_kills_the_program():
    run = sandboxed("import ctypes\nprint('before', flush=True)\nctypes.CDLL(None).syscall(0x40000000 | 39)\n"
                    "print('after')")
    assert (run.returncode, run.stdout) == (128 + 31, "before\n")  # SIGSYS, as bwrap reports it


NORMAL = r"""
import concurrent.futures, json, mmap, multiprocessing, os, subprocess, sys, threading

assert os.path.realpath(sys.executable) == sys.argv[1], (sys.executable, sys.argv[1])
out = []
threads = [threading.Thread(target=out.append, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
with concurrent.futures.ThreadPoolExecutor(4) as pool:
    squares = list(pool.map(lambda x: x * x, range(8)))
child = subprocess.run([sys.executable, "-I", "-c", "import json; print(json.dumps({'child': 6 * 7}))"],
                       capture_output=True, text=True, check=True)
pid = os.fork()
if pid == 0:
    os._exit(7)
forked = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
with multiprocessing.get_context("fork").Pool(2) as pool:
    pooled = pool.map(abs, [-1, -2, -3])
anon = mmap.mmap(-1, 1 << 20)
anon[:5] = b"hello"
fd = os.memfd_create("data")
os.write(fd, b"x" * 4096)
shared = mmap.mmap(fd, 4096)
leaked = [os.readlink(f"/proc/self/fd/{n}") for n in os.listdir("/proc/self/fd")
          if os.path.exists(f"/proc/self/fd/{n}")]
print(json.dumps({"threads": sorted(out), "squares": squares[-1], "child": json.loads(child.stdout),
                  "forked": forked, "pooled": pooled, "mmap": bytes(anon[:5]).decode(),
                  "memfd": shared[:2].decode(), "isatty": sys.stdout.isatty(),
                  "seccomp_fd_left": any("grpo-seccomp" in p for p in leaked)}))
"""


@needs_bwrap
def test_a_normal_program_runs_under_the_filter():
    run = sandboxed(NORMAL, PYTHON)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout) == {"threads": [0, 1, 2, 3], "squares": 49, "child": {"child": 42},
                                      "forked": 7, "pooled": [1, 2, 3], "mmap": "hello", "memfd": "xx",
                                      "isatty": False, "seccomp_fd_left": False}
