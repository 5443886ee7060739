"""A cgroup for one sandboxed run: the kernel bounds the memory and the number of processes of the whole
program (not of each process), and counts what it did about them.

cgroup v2 (one hierarchy): a folder with ``memory.max``, ``memory.swap.max`` 0, ``memory.oom.group`` 1 (an
out-of-memory kill takes the whole program) and ``pids.max``; the kernel's counts are read from
``memory.events`` (``oom_kill``), ``pids.events`` (``max``) and ``cpu.stat`` (``usage_usec``, kept
without the cpu controller). The folder goes under this process's own cgroup when that one hands memory
and pids to its children (its ``cgroup.subtree_control`` lists both: the root cgroup's does), else beside
it under its parent when the parent does (a container whose processes were moved into a leaf, a delegated
systemd subtree). It never enables controllers nor moves a process itself.

cgroup v1 (a hierarchy per controller, as on a host with the hybrid layout): a folder under this
process's own cgroup in the ``memory`` hierarchy (``memory.limit_in_bytes``, and
``memory.memsw.limit_in_bytes`` where swap is accounted, else ``memory.swappiness`` 0), in ``pids``
(``pids.max``) and, where mounted and writable, in ``cpuacct``; the counts from ``memory.oom_control``
(``oom_kill``), ``pids.events`` (``max``) and ``cpuacct.usage``.

Pages of tmpfs files and memfds are charged to the cgroup of the process that writes them, so a sandbox's
``/tmp``, ``/scratch`` and ``/dev/shm`` count against the same ``memory.max``. A run's group costs a few
mkdir, write and rmdir calls, no subprocess. :func:`make` returns it, or why none can be made here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import os
import signal
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

__all__ = ["Events", "Layout", "RunGroup", "layout", "make"]

NEEDED = ("memory", "pids")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where this process sits: its own cgroup folder in the cgroup v2 hierarchy and that hierarchy's mount
    point (None without one), and for each cgroup v1 controller mounted, its own cgroup folder there."""

    v2: Path | None
    v2_mount: Path | None
    v1: Mapping[str, Path]


@functools.lru_cache(maxsize=1)
def layout() -> Layout:
    """This process's cgroup folders, read from ``/proc/self/mountinfo`` and ``/proc/self/cgroup``."""
    return read_layout(Path("/proc/self/mountinfo").read_text(), Path("/proc/self/cgroup").read_text())


def read_layout(mountinfo: str, cgroups: str) -> Layout:
    """:func:`layout` from the two files' text (a mount's root is where its folder starts in the tree)."""
    own = {}  # controller (or "" for v2) -> own path in that hierarchy
    for line in cgroups.splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            own[name] = path
    v2, v2_mount, v1 = None, None, {}
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        parts, (fstype, _, options) = fields.split(), tail.split(" ", 2)
        root, point = (_unescape(p) for p in parts[3:5])
        names = [""] if fstype == "cgroup2" else [o for o in options.split(",") if o in own]
        for name in names if fstype in ("cgroup", "cgroup2") else []:
            if name in own and (own[name] + "/").startswith(root.rstrip("/") + "/"):
                folder = Path(point) / own[name][len(root.rstrip("/")):].lstrip("/")
                if name:
                    v1.setdefault(name, folder)
                elif v2 is None:
                    v2, v2_mount = folder, Path(point)
    return Layout(v2, v2_mount, v1)


def _unescape(field: str) -> str:
    """mountinfo writes a space as ``\\040`` (and tab, newline, backslash likewise)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


@dataclasses.dataclass(frozen=True)
class Events:
    """What the kernel counted in a run's group: out-of-memory kills, refused forks, CPU seconds and the
    peak memory in bytes (None where not accounted)."""

    oom_kills: int
    pids_max: int
    cpu_s: float | None
    peak_bytes: int | None = None


class RunGroup:
    """One run's cgroup: a folder per hierarchy (v2: one), made with the limits already written."""

    def __init__(self, version: int, folders: Mapping[str, Path]) -> None:
        self.version, self.folders = version, dict(folders)

    @property
    def procs(self) -> list[Path]:
        """The ``cgroup.procs`` files a process writes its pid to, to enter the group (each folder once)."""
        return [folder / "cgroup.procs" for folder in dict.fromkeys(self.folders.values())]

    def enter(self, cmd: list[str]) -> list[str]:
        """``cmd`` started inside the group: a shell writes its own pid to each ``cgroup.procs``, then
        becomes the command (nothing runs outside the group, and no Python runs between fork and exec)."""
        procs = [str(path) for path in self.procs]
        script = " && ".join(f'echo $$ > "${i}"' for i in range(len(procs)))
        shift = f" && shift {len(procs) - 1}" if len(procs) > 1 else ""
        return ["/bin/sh", "-c", script + shift + ' && exec "$@"', *procs, *cmd]

    def events(self) -> Events:
        """The kernel's counts now."""
        f = self.folders
        if self.version == 2:
            cpu = _field(f["memory"] / "cpu.stat", "usage_usec")
            return Events(_field(f["memory"] / "memory.events", "oom_kill") or 0,
                          _field(f["pids"] / "pids.events", "max") or 0, None if cpu is None else cpu / 1e6,
                          _number(f["memory"] / "memory.peak"))
        cpu = _number(f["cpuacct"] / "cpuacct.usage") if "cpuacct" in f else None
        return Events(_field(f["memory"] / "memory.oom_control", "oom_kill") or 0,
                      _field(f["pids"] / "pids.events", "max") or 0, None if cpu is None else cpu / 1e9,
                      _number(f["memory"] / "memory.max_usage_in_bytes"))

    def kill(self) -> None:
        """SIGKILL to every process in the group (v2: ``cgroup.kill`` where the kernel has it)."""
        if self.version == 2 and _write(self.folders["pids"] / "cgroup.kill", "1"):
            return
        for _ in range(3):  # a process forked while the list was read is caught on the next pass
            pids = set()
            for procs in self.procs:
                with contextlib.suppress(OSError, ValueError):
                    pids |= {int(pid) for pid in procs.read_text().split()}
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            if not pids:
                return

    def remove(self, wait_s: float = 2.0) -> bool:
        """Removes the folders once the killed processes have left them (they leave as they are reaped)."""
        left, delay, deadline = list(dict.fromkeys(self.folders.values())), 0.001, time.monotonic() + wait_s
        while left:
            for folder in list(left):
                try:
                    folder.rmdir()
                except FileNotFoundError:
                    pass
                except OSError as error:  # EBUSY: processes still in it; ENOTEMPTY: not a cgroup folder
                    if error.errno == errno.ENOTEMPTY:
                        return False
                    continue
                left.remove(folder)
            if not left or time.monotonic() > deadline:
                break
            self.kill()
            time.sleep(delay)
            delay = min(2 * delay, 0.05)
        return not left


def make(memory_bytes: int, pids: int, where: Layout | None = None) -> tuple[RunGroup | None, str]:
    """A run's group with ``memory.max`` = ``memory_bytes`` and ``pids.max`` = ``pids``, or None and why
    none can be made here (v2 when memory and pids are bound to it, else v1)."""
    where = layout() if where is None else where
    why = []
    if where.v2 is not None and set(NEEDED) <= _words(where.v2_mount / "cgroup.controllers"):
        for parent in (where.v2, where.v2.parent) if where.v2 != where.v2_mount else (where.v2,):
            enabled = _words(parent / "cgroup.subtree_control")
            if set(NEEDED) <= enabled and os.access(parent, os.W_OK):
                group = _make_v2(parent, memory_bytes, pids)
                if group is not None:
                    return group, ""
        why.append(_why_not_v2(where.v2))
    elif where.v2 is not None:
        why.append(f"cgroup v2 ({where.v2_mount}): memory and pids are not among its controllers "
                   "(they are bound to cgroup v1)")
    if set(NEEDED) <= set(where.v1):
        parents = {name: where.v1[name] for name in (*NEEDED, "cpuacct") if name in where.v1}
        if all(os.access(parents[name], os.W_OK) for name in NEEDED):
            return _make_v1(parents, memory_bytes, pids), ""
        why.append(f"cgroup v1: this process may not write its memory and pids cgroups "
                   f"({where.v1['memory']}, {where.v1['pids']}; root can delegate them: chown them to it)")
    elif not why:
        why.append("no cgroup hierarchy with the memory and pids controllers is mounted")
    return None, "; ".join(why)


def _make_v2(parent: Path, memory_bytes: int, pids: int) -> RunGroup | None:
    folder = parent / _name()
    try:
        folder.mkdir()
    except OSError:
        return None
    group = RunGroup(2, {"memory": folder, "pids": folder})
    if not (_write(folder / "memory.max", str(memory_bytes)) and _write(folder / "pids.max", str(pids))):
        group.remove()
        return None
    _write(folder / "memory.swap.max", "0")  # absent where swap is not accounted (or there is none)
    _write(folder / "memory.oom.group", "1")  # Linux >= 4.19
    return group


def _make_v1(parents: Mapping[str, Path], memory_bytes: int, pids: int) -> RunGroup:
    name, folders = _name(), {}
    try:
        for controller, parent in parents.items():
            if parent / name in folders.values():  # controllers mounted together share a folder
                folders[controller] = parent / name
                continue
            try:
                (parent / name).mkdir()
            except OSError:
                if controller in NEEDED:
                    raise
                continue
            folders[controller] = parent / name
        memory = folders["memory"]
        _write(memory / "memory.limit_in_bytes", str(memory_bytes), strict=True)
        if (memory / "memory.memsw.limit_in_bytes").exists():  # after the memory limit: memsw >= memory
            _write(memory / "memory.memsw.limit_in_bytes", str(memory_bytes), strict=True)
        else:
            _write(memory / "memory.swappiness", "0")
        _write(folders["pids"] / "pids.max", str(pids), strict=True)
    except OSError:
        RunGroup(1, folders).remove()
        raise
    return RunGroup(1, folders)


def _why_not_v2(own: Path) -> str:
    """Why neither this process's v2 cgroup nor its parent can hold a run's group, with the fix."""
    enabled = " ".join(sorted(_words(own / "cgroup.subtree_control"))) or "nothing"
    writable = "writable" if os.access(own, os.W_OK) else "read-only"
    return (f"cgroup v2: this process's cgroup {own} ({writable}) enables {enabled} for its children and "
            "its parent does not enable memory and pids either; the kernel lets a cgroup that holds "
            "processes enable none (so a container's root cgroup cannot). Fix: give the trainer a cgroup "
            "of its own below one that enables them: on a host `systemd-run --scope -p Delegate=yes "
            "<command>` (root) or `systemd-run --user --scope -p Delegate=yes <command>`; in a container "
            "with /sys/fs/cgroup writable (e.g. docker --privileged --cgroupns=private), first move its "
            "processes into a leaf and enable them: `mkdir /sys/fs/cgroup/init && xargs -rn1 < "
            "/sys/fs/cgroup/cgroup.procs > /sys/fs/cgroup/init/cgroup.procs && echo '+memory +pids' > "
            "/sys/fs/cgroup/cgroup.subtree_control`")


def _name() -> str:
    return f"grpo-sandbox-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _words(path: Path) -> set[str]:
    try:
        return set(path.read_text().split())
    except OSError:
        return set()


def _write(path: Path, value: str, strict: bool = False) -> bool:
    try:
        path.write_text(value)
        return True
    except OSError:
        if strict:
            raise
        return False


def _field(path: Path, key: str) -> int | None:
    """The number after ``key`` in a flat-keyed cgroup file (``oom_kill 3``), None when absent."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def _number(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None
