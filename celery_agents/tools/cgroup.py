"""A control group per sandboxed run: the memory and process limits hold for the run's whole tree.

rlimits bound each process on its own (address space, and processes per uid); a tool that forks
can still use `memoryMb` in every child. Where the worker may create control groups (root, with
the memory and pids controllers mounted writable: cgroup v1, or a v2 hierarchy whose worker cgroup
can delegate), each runIsolated run gets a cgroup of its own below the worker's, with `memoryMb`
as the limit of all its processes together (swap too, where the kernel accounts it),
`processes` as their count (bubblewrap's own two processes added), and the
kernel's OOM kills counted, so that a run killed for memory says so. Elsewhere runs go without
(`memory_scope` in the call's meta says which); `AGENTS_SANDBOX_CGROUP=off` turns it off.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: the folder, below the worker's own cgroup, that holds one cgroup per run
PARENT = "celery-agents"
_MB = 1024 * 1024


@dataclass(frozen=True)
class _Hierarchy:
    version: int
    #: controller -> the worker's own cgroup folder for it (v2: one folder for all)
    folders: dict[str, Path]


def _own_hierarchy(mountinfo: str, self_cgroup: str) -> _Hierarchy | None:
    """Where the worker's memory and pids cgroups are, from /proc/self/mountinfo and /proc/self/cgroup."""
    mounts: dict[str, tuple[str, str]] = {}  # controller (or "" for v2) -> (mount point, root)
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        root, point, fstype = fields[3], fields[4], tail[0]
        if fstype == "cgroup2":
            mounts.setdefault("", (point, root))
        elif fstype == "cgroup":
            for option in tail[2].split(","):
                if option in ("memory", "pids"):
                    mounts.setdefault(option, (point, root))
    paths: dict[str, str] = {}
    for line in self_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(",") if parts[1] else [""]:
            paths[controller] = parts[2]

    def folder(key: str) -> Path | None:
        if key not in mounts or key not in paths:
            return None
        point, root = mounts[key]
        path = paths[key]
        if root != "/" and not (path == root or path.startswith(root.rstrip("/") + "/")):
            return None
        rel = (path if root == "/" else path[len(root) :]).lstrip("/")
        return Path(point, rel) if rel else Path(point)

    memory, pids = folder("memory"), folder("pids")
    if memory is not None and pids is not None:
        return _Hierarchy(1, {"memory": memory, "pids": pids})
    unified = folder("")
    if unified is not None and (unified / "cgroup.controllers").exists():
        return _Hierarchy(2, {"memory": unified, "pids": unified})
    return None


class RunCgroup:
    """One run's cgroup(s): join by writing a pid to each of `procs_files`; `remove()` afterwards."""

    def __init__(self, version: int, folders: dict[str, Path]) -> None:
        self.version = version
        self.folders = folders

    @property
    def procs_files(self) -> list[str]:
        return [str(f / "cgroup.procs") for f in dict.fromkeys(self.folders.values())]

    def oom_kills(self) -> int:
        """How many processes of the run the kernel killed for going past the memory limit."""
        memory = self.folders["memory"]
        source = memory / ("memory.events" if self.version == 2 else "memory.oom_control")
        with contextlib.suppress(OSError, ValueError):
            for line in source.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def remove(self) -> None:
        """Kill what is left of the run (the supervisor normally has), then remove its cgroups
        (exiting processes may take a moment to leave them)."""
        for folder in dict.fromkeys(self.folders.values()):
            _kill_members(folder)
            for attempt in range(50):
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY or attempt == 49:
                        log.warning("could not remove the sandbox cgroup %s: %s", folder, exc)
                        break
                    time.sleep(0.02)


class Cgroups:
    """Makes run cgroups when this process may; probed once per process."""

    def __init__(self, mode: str = "auto") -> None:
        self.mode = mode
        self._hierarchy: _Hierarchy | bool | None = False  # False: not probed yet

    def _probe(self) -> _Hierarchy | None:
        if self.mode == "off" or os.geteuid() != 0:
            return None
        try:
            found = _own_hierarchy(Path("/proc/self/mountinfo").read_text(), Path("/proc/self/cgroup").read_text())
        except OSError:
            return None
        if found is None:
            return None
        try:
            for own in dict.fromkeys(found.folders.values()):
                if found.version == 2:
                    # Fails (EBUSY) where the worker's cgroup holds processes and is not the root.
                    (own / "cgroup.subtree_control").write_text("+memory +pids")
                parent = own / PARENT
                parent.mkdir(exist_ok=True)
                if found.version == 2:
                    (parent / "cgroup.subtree_control").write_text("+memory +pids")
            _remove_leftovers(found)
        except OSError as exc:
            log.info("sandboxed runs go without a cgroup of their own (%s); limits hold per process", exc)
            return None
        return found

    def available(self) -> bool:
        return self._found() is not None

    def leftovers(self) -> list[Path]:
        """Run cgroups of this process that still exist (none once every run has ended)."""
        hierarchy = self._found()
        if hierarchy is None:
            return []
        prefix = f"run-{os.getpid()}-"
        return [
            entry
            for own in dict.fromkeys(hierarchy.folders.values())
            for entry in (own / PARENT).iterdir()
            if entry.name.startswith(prefix)
        ]

    def _found(self) -> _Hierarchy | None:
        if self._hierarchy is False:
            self._hierarchy = self._probe()
        return self._hierarchy if isinstance(self._hierarchy, _Hierarchy) else None

    def create(self, memory_mb: int | None, processes: int | None) -> RunCgroup | None:
        """A fresh cgroup with these limits, or None where runs go without."""
        hierarchy = self._found()
        if hierarchy is None:
            return None
        name = f"run-{os.getpid()}-{secrets.token_hex(6)}"
        folders = {c: own / PARENT / name for c, own in hierarchy.folders.items()}
        run = RunCgroup(hierarchy.version, folders)
        try:
            for folder in dict.fromkeys(folders.values()):
                folder.mkdir()
            _limit(hierarchy.version, folders, memory_mb, processes)
        except OSError as exc:
            log.warning("could not set up a sandbox cgroup (%s); this run's limits hold per process", exc)
            run.remove()
            return None
        return run


def _kill_members(folder: Path) -> None:
    kill = folder / "cgroup.kill"  # cgroup v2 (Linux 5.14+): the whole cgroup at once
    with contextlib.suppress(OSError):
        if kill.exists():
            kill.write_text("1")
            return
    with contextlib.suppress(OSError, ValueError):
        for pid in (folder / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)


def _limit(version: int, folders: dict[str, Path], memory_mb: int | None, processes: int | None) -> None:
    memory, pids = folders["memory"], folders["pids"]
    if version == 1:
        if memory_mb:
            (memory / "memory.limit_in_bytes").write_text(str(memory_mb * _MB))
            swap = memory / "memory.memsw.limit_in_bytes"
            if swap.exists():  # only with swap accounting on; then swap counts against the same limit
                swap.write_text(str(memory_mb * _MB))
        if processes:
            (pids / "pids.max").write_text(str(processes))
        return
    if memory_mb:
        (memory / "memory.max").write_text(str(memory_mb * _MB))
        with contextlib.suppress(FileNotFoundError):
            (memory / "memory.swap.max").write_text("0")
    if processes:
        (pids / "pids.max").write_text(str(processes))


def _remove_leftovers(hierarchy: _Hierarchy) -> None:
    """Empty run cgroups a killed worker process left behind (a cgroup with processes stays)."""
    for own in dict.fromkeys(hierarchy.folders.values()):
        with contextlib.suppress(OSError):
            for entry in (own / PARENT).iterdir():
                if entry.is_dir() and entry.name.startswith("run-"):
                    pid = entry.name.split("-")[1]
                    if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                        with contextlib.suppress(OSError):
                            entry.rmdir()
