"""The seccomp filter the sandbox installs: a classic-BPF program for bubblewrap's ``--seccomp FD``.

bwrap reads the program (an array of ``struct sock_filter``) from the descriptor and installs it, with
``no_new_privs``, just before it starts the sandboxed program; every process and thread the program
starts inherits it and none can remove it. The program, for one architecture (x86-64 or AArch64):

1. ``seccomp_data.arch`` is not this architecture (an i386 ``int 0x80`` call, a 32-bit ARM binary,
   anything unknown): kill the process (``SECCOMP_RET_KILL_PROCESS``, SIGSYS; fail closed).
2. x86-64: a call of the x32 ABI (``nr >= 0x40000000``): kill; the table below holds x86-64 numbers.
3. A call in :data:`DENIED`: refused with its errno, ``EPERM``, or ``ENOSYS`` where a library then
   falls back (``clone3``, whose flags sit behind a pointer: glibc retries with ``clone``; io_uring) or
   the call is too new to be relied on (``statmount``, ``listmount``, ``memfd_secret``).
4. Calls refused for some arguments only (the low 32 bits are compared: the kernel reads each as a
   32-bit ``int`` / ``unsigned int``): ``clone`` with a namespace flag, ``ioctl`` ``TIOCSTI`` /
   ``TIOCLINUX``, ``personality`` other than the usual values, ``socket`` of ``AF_ALG`` / ``AF_VSOCK``.
5. Anything else: allowed. Threads, ``subprocess``, ``mmap`` and ``memfd_create`` keep working; memory
   is capped elsewhere (the sandbox's cgroup and limits).

Example:
    >>> len(seccomp_filter("x86_64")) % 8  # whole sock_filter records
    0
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import platform
import struct
from collections.abc import Iterator, Mapping

__all__ = ["ARCHES", "DENIED", "SYSCALL_NUMBERS", "seccomp_fd", "seccomp_filter"]

EPERM, ENOSYS = errno.EPERM, errno.ENOSYS

# linux/bpf_common.h: BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_{JEQ,JGE,JSET}|BPF_K, BPF_RET|BPF_K
_LOAD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
# linux/seccomp.h: actions
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
# struct seccomp_data {int nr; u32 arch; u64 instruction_pointer; u64 args[6];}, little-endian on both arches
_NR, _ARCH = 0, 4
_X32_SYSCALL_BIT = 0x40000000

# linux/audit.h: EM_* | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE
ARCHES: Mapping[str, int] = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}

# Refused for every argument: name -> errno (the same names on every arch; a name an arch lacks is skipped)
DENIED: Mapping[str, int] = {
    # namespaces: a nested user namespace hands the program root's powers over fresh kernel code
    "unshare": EPERM, "setns": EPERM, "clone3": ENOSYS,
    # mounts and the root directory
    "mount": EPERM, "umount2": EPERM, "pivot_root": EPERM, "chroot": EPERM, "move_mount": EPERM,
    "open_tree": EPERM, "open_tree_attr": EPERM, "fsopen": EPERM, "fsmount": EPERM, "fsconfig": EPERM,
    "fspick": EPERM, "mount_setattr": EPERM, "statmount": ENOSYS, "listmount": ENOSYS,
    # programs and rings run by the kernel
    "bpf": EPERM, "io_uring_setup": ENOSYS, "io_uring_enter": ENOSYS, "io_uring_register": ENOSYS,
    "perf_event_open": EPERM, "userfaultfd": EPERM,
    # other processes' memory and descriptors
    "ptrace": EPERM, "process_vm_readv": EPERM, "process_vm_writev": EPERM, "kcmp": EPERM,
    "pidfd_getfd": EPERM, "process_madvise": EPERM, "migrate_pages": EPERM, "move_pages": EPERM,
    # the kernel keyring
    "keyctl": EPERM, "add_key": EPERM, "request_key": EPERM,
    # the kernel itself, the machine, the system's clock and names
    "kexec_load": EPERM, "kexec_file_load": EPERM, "init_module": EPERM, "finit_module": EPERM,
    "delete_module": EPERM, "reboot": EPERM, "swapon": EPERM, "swapoff": EPERM, "acct": EPERM,
    "quotactl": EPERM, "quotactl_fd": EPERM, "lookup_dcookie": EPERM, "syslog": EPERM, "vhangup": EPERM,
    "sethostname": EPERM, "setdomainname": EPERM, "settimeofday": EPERM, "clock_settime": EPERM,
    "clock_adjtime": EPERM, "adjtimex": EPERM, "iopl": EPERM, "ioperm": EPERM, "modify_ldt": EPERM,
    "uselib": EPERM, "_sysctl": EPERM, "nfsservctl": EPERM, "fanotify_init": EPERM,
    "memfd_secret": ENOSYS,
    # files by handle, past every mount and chroot (the "shocker" container escape)
    "open_by_handle_at": EPERM, "name_to_handle_at": EPERM,
    # System V IPC: segments and queues outlive their process, and without a cgroup no limit bounds them
    # (POSIX shared memory, /dev/shm, is a sized tmpfs)
    "shmget": EPERM, "semget": EPERM, "msgget": EPERM,
}

# clone's namespace flags (linux/sched.h): NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET.
# (CLONE_NEWTIME, 0x80, is clone's exit-signal byte; only clone3 and unshare take it, both refused above.)
CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
TIOCSTI, TIOCLINUX = 0x5412, 0x541C  # asm-generic/ioctls.h, the same on both arches
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)  # PER_LINUX, PER_LINUX32, UNAME26 of each, query
AF_ALG, AF_VSOCK = 38, 40  # kernel crypto sockets; vsock, which no network namespace isolates

# Syscall numbers. x86-64: arch/x86/entry/syscalls/syscall_64.tbl; aarch64: the generic table,
# include/uapi/asm-generic/unistd.h (scripts/syscall.tbl since 6.11). Numbers from 424 on are common to
# both. Checked against this machine's headers by tests/test_seccomp.py.
_COMMON = {"pidfd_getfd": 438, "clone3": 435, "open_tree": 428, "move_mount": 429, "fsopen": 430,
           "fsconfig": 431, "fsmount": 432, "fspick": 433, "io_uring_setup": 425, "io_uring_enter": 426,
           "io_uring_register": 427, "process_madvise": 440, "mount_setattr": 442, "quotactl_fd": 443,
           "memfd_secret": 447, "statmount": 457, "listmount": 458, "open_tree_attr": 467}
SYSCALL_NUMBERS: Mapping[str, Mapping[str, int]] = {
    "x86_64": {
        **_COMMON, "ioctl": 16, "shmget": 29, "socket": 41, "clone": 56, "semget": 64, "msgget": 68,
        "ptrace": 101, "syslog": 103, "uselib": 134,
        "personality": 135, "vhangup": 153, "modify_ldt": 154, "pivot_root": 155, "_sysctl": 156,
        "adjtimex": 159, "chroot": 161, "acct": 163, "settimeofday": 164, "mount": 165, "umount2": 166,
        "swapon": 167, "swapoff": 168, "reboot": 169, "sethostname": 170, "setdomainname": 171,
        "iopl": 172, "ioperm": 173, "init_module": 175, "delete_module": 176, "quotactl": 179,
        "nfsservctl": 180, "lookup_dcookie": 212, "clock_settime": 227, "kexec_load": 246,
        "add_key": 248, "request_key": 249, "keyctl": 250, "migrate_pages": 256, "unshare": 272,
        "move_pages": 279, "perf_event_open": 298, "fanotify_init": 300, "name_to_handle_at": 303,
        "open_by_handle_at": 304, "clock_adjtime": 305, "setns": 308, "process_vm_readv": 310,
        "process_vm_writev": 311, "kcmp": 312, "finit_module": 313, "kexec_file_load": 320, "bpf": 321,
        "userfaultfd": 323},
    "aarch64": {
        **_COMMON, "lookup_dcookie": 18, "ioctl": 29, "umount2": 39, "mount": 40, "pivot_root": 41,
        "nfsservctl": 42, "chroot": 51, "vhangup": 58, "quotactl": 60, "acct": 89, "personality": 92,
        "unshare": 97, "kexec_load": 104, "init_module": 105, "delete_module": 106, "clock_settime": 112,
        "syslog": 116, "ptrace": 117, "reboot": 142, "sethostname": 161, "setdomainname": 162,
        "settimeofday": 170, "adjtimex": 171, "socket": 198, "add_key": 217, "request_key": 218,
        "msgget": 186, "semget": 190, "shmget": 194, "keyctl": 219, "clone": 220, "swapon": 224,
        "swapoff": 225, "migrate_pages": 238,
        "move_pages": 239, "perf_event_open": 241, "fanotify_init": 262, "name_to_handle_at": 264,
        "open_by_handle_at": 265, "clock_adjtime": 266, "setns": 268, "process_vm_readv": 270,
        "process_vm_writev": 271, "kcmp": 272, "finit_module": 273, "bpf": 280, "userfaultfd": 282,
        "kexec_file_load": 294},
}


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    assert 0 <= jt <= 255 and 0 <= jf <= 255 and 0 <= k <= 0xFFFFFFFF
    return struct.pack("=HBBI", code, jt, jf, k)


def _arg(index: int) -> bytes:
    """Load the low 32 bits of ``args[index]`` (little-endian: the first word)."""
    return _op(_LOAD, 16 + 8 * index)


def _deny(nr: int, action: int) -> list[bytes]:
    return [_op(_JEQ, nr, 0, 1), _op(_RET, action)]


def _deny_masked(nr: int, arg: int, mask: int, action: int) -> list[bytes]:
    """``action`` when ``args[arg]`` has a bit of ``mask``, else allow (every path returns: the
    accumulator no longer holds the number)."""
    body = [_arg(arg), _op(_JSET, mask, 0, 1), _op(_RET, action), _op(_RET, RET_ALLOW)]
    return [_op(_JEQ, nr, 0, len(body)), *body]


def _one_of(nr: int, arg: int, values: tuple[int, ...], match: int, other: int) -> list[bytes]:
    """``match`` when ``args[arg]`` is one of ``values``, else ``other``."""
    n = len(values)
    body = [_arg(arg), *(_op(_JEQ, v, n - j, 0) for j, v in enumerate(values)), _op(_RET, other),
            _op(_RET, match)]
    return [_op(_JEQ, nr, 0, len(body)), *body]


def _arch(arch: str | None) -> str:
    name = (arch or platform.machine()).lower()
    name = _ALIASES.get(name, name)
    if name not in ARCHES:
        raise ValueError(f"seccomp_filter: arch={arch or platform.machine()!r} has no syscall table; "
                         f"known: {', '.join(ARCHES)} (add its numbers to SYSCALL_NUMBERS to support it)")
    return name


@functools.lru_cache(maxsize=4)
def _program(arch: str) -> bytes:
    numbers = SYSCALL_NUMBERS[arch]
    eperm = RET_ERRNO | EPERM
    ops = [_op(_LOAD, _ARCH), _op(_JEQ, ARCHES[arch], 1, 0), _op(_RET, RET_KILL_PROCESS), _op(_LOAD, _NR)]
    if arch == "x86_64":
        ops += [_op(_JGE, _X32_SYSCALL_BIT, 0, 1), _op(_RET, RET_KILL_PROCESS)]
    for name, code in DENIED.items():
        if name in numbers:
            ops += _deny(numbers[name], RET_ERRNO | code)
    ops += _deny_masked(numbers["clone"], 0, CLONE_NAMESPACES, eperm)
    ops += _one_of(numbers["ioctl"], 1, (TIOCSTI, TIOCLINUX), match=eperm, other=RET_ALLOW)
    ops += _one_of(numbers["personality"], 0, PERSONALITIES, match=RET_ALLOW, other=eperm)
    ops += _one_of(numbers["socket"], 0, (AF_ALG, AF_VSOCK), match=eperm, other=RET_ALLOW)
    ops.append(_op(_RET, RET_ALLOW))
    assert len(ops) <= 4096  # BPF_MAXINSNS
    return b"".join(ops)


def seccomp_filter(arch: str | None = None) -> bytes:
    """The filter as bwrap's ``--seccomp`` reads it: ``struct sock_filter`` records, 8 bytes each.

    Args:
        arch: ``"x86_64"`` or ``"aarch64"`` (``"amd64"``, ``"arm64"`` too); default this machine's.

    Raises:
        ValueError: an architecture without a syscall table here (the sandbox then fails closed).

    Example:
        >>> program = seccomp_filter("aarch64")
        >>> struct.unpack_from("=HBBI", program, 0)  # load seccomp_data.arch
        (32, 0, 0, 4)
    """
    return _program(_arch(arch))


@contextlib.contextmanager
def seccomp_fd(arch: str | None = None) -> Iterator[int]:
    """A descriptor to read the filter from, for ``bwrap --seccomp FD``; closed when the block ends.

    A fresh sealed memfd (a pipe where memfd_create is missing) per call: bwrap reads it from its offset,
    which a descriptor shares with every copy, so one descriptor serves one bwrap. It is close-on-exec,
    so no other child of a threaded trainer inherits it; give it to bwrap with ``pass_fds``.

    Example:
        >>> with seccomp_fd("x86_64") as fd:
        ...     os.read(fd, 8) == seccomp_filter("x86_64")[:8]
        ...     # subprocess.run(["bwrap", ..., "--seccomp", str(fd), ...], pass_fds=(fd,))
        True
    """
    fd = _write(seccomp_filter(arch))
    try:
        yield fd
    finally:
        os.close(fd)


def _write(program: bytes) -> int:
    try:
        fd = os.memfd_create("grpo-seccomp", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (AttributeError, OSError):  # no memfd_create: a pipe (the program is far below its capacity)
        fd, write = os.pipe()
        try:
            _write_all(write, program)
        finally:
            os.close(write)
        return fd
    try:
        _write_all(fd, program)
        seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
