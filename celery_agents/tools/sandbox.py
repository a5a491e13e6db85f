"""The runIsolated sandbox: one tool run in a confined child process, with nothing of the worker.

Each run gets a fresh temporary working directory (removed afterwards, also `HOME` and `TMPDIR`),
an environment built from an allow-list (`PATH`, `LANG`, the call's `AGENTS_*` variables and only
the variables the tool names in `env`), rlimits (address space, CPU seconds, open files, file
size, processes; `Limits` defaults below, overridden by the tool then the disposition), a
wall-clock timeout and an output cap. The supervisor (`confine.py`) kills the tool's whole tree.
A worker running as root drops the tool to a uid of its own for the run (so the process limit
holds and the worker's files are out of reach). Where bubblewrap works, it also hides the
filesystem and the network (`bubblewrap.py`). docs/tools.md says what each level protects against.

Where the worker may create control groups, the run's processes together are held to the memory
and process limits too (`cgroup.py`).

Settings (worker environment): `AGENTS_SANDBOX_BWRAP` = `auto` (use it when it works, the
default), `off`, or `require` (refuse to run without it); `AGENTS_SANDBOX_UID` = `auto` (a uid
per run when root, the default), `off`, or a fixed uid; `AGENTS_SANDBOX_CGROUP` = `auto` (a
cgroup per run where possible, the default) or `off`; `AGENTS_SANDBOX_DIR`: where the temporary
directories go.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from celery_agents.model.agent import Limits
from celery_agents.tools.bubblewrap import bwrap_argv, bwrap_path
from celery_agents.tools.cgroup import Cgroups
from celery_agents.tools.process import ProcessResult, run_process

log = logging.getLogger(__name__)

DEFAULT_LIMITS = Limits(
    memory_mb=1024, cpu_seconds=60, open_files=256, file_size_mb=64, processes=64, output_bytes=1_000_000
)
CONFINE = str(Path(__file__).with_name("confine.py"))
#: the variables a sandboxed tool gets from the worker, whatever the tool asks
ALLOWED_ENV = ("PATH", "LANG")
_UID_BASE, _UID_SPAN = 200_000_000, 1 << 24
#: extra seconds the worker waits for the supervisor beyond the tool's own timeout and grace
_BACKSTOP = 5.0
#: processes of bubblewrap's own in a run's cgroup: bwrap, and its init (pid 1 of the namespace)
_BWRAP_PROCESSES = 2


class SandboxUnavailable(Exception):
    """The sandbox the worker is configured for cannot run here."""


@dataclass(frozen=True)
class SandboxConfig:
    bwrap: str = "auto"
    uid: str = "auto"
    root: str | None = None
    cgroup: str = "auto"

    @classmethod
    def from_env(cls) -> SandboxConfig:
        env = os.environ
        return cls(
            bwrap=(env.get("AGENTS_SANDBOX_BWRAP") or "auto").lower(),
            uid=(env.get("AGENTS_SANDBOX_UID") or "auto").lower(),
            root=env.get("AGENTS_SANDBOX_DIR") or None,
            cgroup=(env.get("AGENTS_SANDBOX_CGROUP") or "auto").lower(),
        )


@dataclass
class SandboxRun:
    """A sandboxed run: the process result plus how it was confined."""

    process: ProcessResult
    isolation: str
    uid: int | None
    limits: Limits
    status: dict[str, object] = field(default_factory=dict)

    @property
    def meta(self) -> dict[str, object]:
        out: dict[str, object] = {
            "isolation": self.isolation,
            "uid": self.uid,
            "limits": self.limits.model_dump(by_alias=True, exclude_none=True),
        }
        if self.status.get("uid_note"):
            out["uid_note"] = self.status["uid_note"]
        out["memory_scope"] = self.status.get("memory_scope", "process")
        if self.status.get("oom_kills"):
            out["oom_kills"] = self.status["oom_kills"]
        return out

    @property
    def out_of_memory(self) -> str | None:
        """Why the run failed when the kernel killed some of its processes for memory, else None."""
        kills = self.status.get("oom_kills")
        if not kills:
            return None
        return (
            f"out of memory: the run's processes together went past memoryMb={self.limits.memory_mb} "
            f"and the kernel killed {kills} of them"
        )


def rlimits(limits: Limits) -> dict[str, int | list[int]]:
    mb = 1024 * 1024
    out: dict[str, int | list[int]] = {"RLIMIT_CORE": 0}
    if limits.memory_mb:
        out["RLIMIT_AS"] = limits.memory_mb * mb
    if limits.cpu_seconds:
        # SIGXCPU at the limit (a clear cause), SIGKILL a second later if the tool ignores it.
        out["RLIMIT_CPU"] = [limits.cpu_seconds, limits.cpu_seconds + 1]
    if limits.open_files:
        out["RLIMIT_NOFILE"] = limits.open_files
    if limits.file_size_mb:
        out["RLIMIT_FSIZE"] = limits.file_size_mb * mb
    if limits.processes:
        out["RLIMIT_NPROC"] = limits.processes
    return out


def sandbox_env(call_env: dict[str, str], names: Iterable[str], workdir: str) -> dict[str, str]:
    """The allow-list: PATH, LANG, HOME and TMPDIR in the run's directory, the call's variables,
    and the variables the tool names (never the worker's own `AGENTS_*` settings)."""
    env = {k: os.environ[k] for k in ALLOWED_ENV if k in os.environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.setdefault("LANG", "C.UTF-8")
    for name in names:
        if name in os.environ and not name.upper().startswith("AGENTS_"):
            env[name] = os.environ[name]
    env.update({"HOME": workdir, "TMPDIR": workdir, **call_env})
    return env


def python_paths() -> list[str]:
    """What a child interpreter needs to import what this one imports."""
    import celery_agents

    paths = [*python_install(), str(Path(celery_agents.__file__).parent.parent)]
    paths += [p for p in sys.path if p and os.path.exists(p)]
    return list(dict.fromkeys(os.path.abspath(p) for p in paths))


class Sandbox:
    """Runs argv confined; see the module docstring. One per worker process."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig.from_env()
        self._bwrap: str | bool | None = False  # False: not probed yet
        self.cgroups = Cgroups(self.config.cgroup)

    # -- how a run is confined ---------------------------------------------------------------
    def _uid(self) -> int | None:
        mode = self.config.uid
        if mode == "off":
            return None
        if mode != "auto":
            return int(mode)
        if os.geteuid() != 0:
            return None
        return _UID_BASE + secrets.randbelow(_UID_SPAN)

    def bwrap(self) -> str | None:
        """The bwrap to use, probed once per process; None when runs go without it."""
        if self._bwrap is False:
            self._bwrap = None
            found = bwrap_path() if self.config.bwrap != "off" else None
            if found:
                true = shutil.which("true") or "/bin/true"
                probe = self._run([true], b"", {}, [], DEFAULT_LIMITS, 30.0, (found, [true], False), needs=[true])
                if probe.process.exit_status == 0:
                    self._bwrap = found
                else:
                    why = probe.process.stderr.decode(errors="replace").strip()
                    log.warning(
                        "bubblewrap is installed but cannot run here (%s); sandboxed tools run with rlimits only", why
                    )
            if self._bwrap is None and self.config.bwrap == "require":
                raise SandboxUnavailable(
                    "bubblewrap is required (AGENTS_SANDBOX_BWRAP=require) but "
                    f"{'does not run here' if found else 'is not installed (bwrap)'}"
                )
        return self._bwrap  # type: ignore[return-value]

    def run(
        self,
        argv: Sequence[str],
        stdin: bytes,
        *,
        call_env: dict[str, str],
        env_names: Iterable[str] = (),
        limits: Limits = DEFAULT_LIMITS,
        timeout: float,
        network: bool = False,
        readable: Iterable[str] = (),
        needs: Iterable[str] = (),
    ) -> SandboxRun:
        """Run argv confined. `needs`: the files the tool cannot run without (its program, its
        script); `readable`: everything it may read (bound read-only under bubblewrap)."""
        bwrap = self.bwrap()
        needed = list(needs)
        return self._run(
            list(argv),
            stdin,
            call_env,
            list(env_names),
            limits,
            timeout,
            (bwrap, [*readable, *needed], network) if bwrap else None,
            needs=needed,
        )

    def _run(
        self,
        argv: list[str],
        stdin: bytes,
        call_env: dict[str, str],
        env_names: list[str],
        limits: Limits,
        timeout: float,
        wrap: tuple[str, list[str], bool] | None,
        needs: list[str],
        grace: float = 1.0,
    ) -> SandboxRun:
        workdir = tempfile.mkdtemp(prefix="agents-sandbox-", dir=self.config.root)
        uid = self._uid()
        drop_here = uid
        note = None
        if uid is not None and wrap is not None:
            # bwrap runs as root and the drop happens inside, where bound paths are reachable.
            argv = [sys.executable, "-I", "-S", "-B", CONFINE, "drop", str(uid), workdir, "--", *argv]
            wrap = (wrap[0], [*wrap[1], *python_install(), os.path.dirname(CONFINE)], wrap[2])
            drop_here = None
        elif uid is not None:
            hidden = [p for p in needs if not reachable_by_others(p)]
            if hidden:
                uid = drop_here = None
                note = (
                    f"kept the worker's uid: {hidden[0]} is not readable by other users "
                    "(install bubblewrap, or keep tools in folders others can read)"
                )
        processes = limits.processes
        if processes and wrap is not None:
            processes += _BWRAP_PROCESSES  # bubblewrap itself and its pid 1 are in the cgroup too
        cgroup = self.cgroups.create(limits.memory_mb, processes)
        oom_kills = 0
        status_r, status_w = os.pipe()
        try:
            if uid is not None:
                os.chown(workdir, uid, uid)
            if wrap is not None:
                argv = bwrap_argv(wrap[0], workdir, wrap[1], wrap[2], as_root=os.geteuid() == 0) + argv
            cfg = {
                "argv": argv,
                "limits": rlimits(limits),
                "nproc_extra": uid is None,
                "uid": drop_here,
                "gid": drop_here,
                "timeout": timeout,
                "grace": grace,
                "status_fd": status_w,
                "cgroup_procs": cgroup.procs_files if cgroup else [],
            }
            launcher = [sys.executable, "-I", "-S", "-B", CONFINE, json.dumps(cfg)]
            result = run_process(
                launcher,
                stdin,
                env=sandbox_env(call_env, env_names, workdir),
                cwd=workdir,
                timeout=timeout + grace + _BACKSTOP,
                output_cap=limits.output_bytes or 1_000_000,
                grace=grace,
                pass_fds=(status_w,),
            )
            os.close(status_w)
            status_w = -1
            status = _read_status(status_r)
        finally:
            if status_w >= 0:
                os.close(status_w)
            os.close(status_r)
            _remove(workdir)
            if cgroup is not None:
                oom_kills = cgroup.oom_kills()
                cgroup.remove()
        if status:
            result.exit_status = status.get("exit_status")  # type: ignore[assignment]
            result.timed_out = result.timed_out or bool(status.get("timed_out"))
        if wrap is not None and result.exit_status is not None and 128 < result.exit_status <= 128 + 64:
            # bwrap's init reports a tool killed by signal N as exit status 128 + N.
            result.exit_status = 128 - result.exit_status
        if note:
            status["uid_note"] = note
        status["memory_scope"] = "run" if cgroup is not None else "process"
        if cgroup is not None and oom_kills:
            status["oom_kills"] = oom_kills
        return SandboxRun(result, "bwrap" if wrap else "rlimits", uid, limits, status)


def python_install() -> list[str]:
    return list(dict.fromkeys([sys.prefix, sys.base_prefix, sys.exec_prefix]))


def reachable_by_others(path: str) -> bool:
    """Whether a user other than the owner may reach and read `path` (every parent searchable)."""
    for candidate in dict.fromkeys([os.path.abspath(path), os.path.realpath(path)]):
        parts = Path(candidate).parts
        for i in range(1, len(parts)):
            try:
                mode = os.stat(os.path.join(*parts[:i])).st_mode
            except OSError:
                return False
            if not mode & stat.S_IXOTH:
                return False
        try:
            mode = os.stat(candidate).st_mode
        except OSError:
            return False
        if not mode & stat.S_IROTH and not (stat.S_ISREG(mode) and mode & stat.S_IXOTH and not _is_script(candidate)):
            return False
    return True


def _is_script(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


def _read_status(fd: int) -> dict[str, object]:
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    try:
        return json.loads(data.decode().strip().splitlines()[-1]) if data.strip() else {}
    except (json.JSONDecodeError, IndexError):
        return {}


def _remove(path: str) -> None:
    def retry(func: object, p: str, _exc: object) -> None:
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.unlink(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=retry)
