"""The runIsolated sandbox: one tool run in a confined child process, with nothing of the worker.

Each run gets a fresh temporary working directory (also `HOME` and `TMPDIR`; removed afterwards
without following any link the tool left there: `rundir.py`),
an environment built from an allow-list (`PATH`, `LANG`, the call's `AGENTS_*` variables and only
the variables the tool names in `env`), rlimits (address space, CPU seconds, open files, file
size, processes; `Limits` defaults below, overridden by the tool then the disposition), a
wall-clock timeout and an output cap. The supervisor (`confine.py`) kills the tool's whole tree.

How a run is contained, decided once per process (`Sandbox.containment`): under bubblewrap where
it works (`bubblewrap.py`: the filesystem hidden), else in namespaces the supervisor creates
itself (`confine.py`: no network, read-only filesystem, private /tmp, other runs and the worker's
processes hidden), else not at all: the call fails saying why. A root worker drops every run to
a uid of its own; one that cannot (the tool unreadable by that uid, without bubblewrap) fails
the call rather than run it as root. What a run may reach comes from the agent file, never from
the model's arguments. docs/security.md says what holds in each worker mode.

Where the worker may create control groups, the run's processes together are held to the memory
and process limits too (`cgroup.py`).

Settings (worker environment): `AGENTS_SANDBOX_BWRAP` = `auto` (use it when it works, the
default), `off` (namespaces only), or `require` (refuse to run without it); `AGENTS_SANDBOX_UID` =
`auto` (a uid per run when root, the default), or a fixed uid (`off` refuses runs on a root
worker); `AGENTS_SANDBOX_CGROUP` = `auto` (a cgroup per run where possible, the default) or
`off`; `AGENTS_SANDBOX_DIR`: where the temporary directories go.
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

from celery_agents.config import Settings
from celery_agents.model import CallMeta
from celery_agents.model.agent import Limits
from celery_agents.tools.bubblewrap import bwrap_argv, bwrap_path
from celery_agents.tools.cgroup import Cgroups
from celery_agents.tools.process import ProcessResult, run_process
from celery_agents.tools.rundir import remove_run_dir

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
#: processes of the sandbox's own in a run's cgroup: bwrap and its init, or the relay and pid 1
_RELAY_PROCESSES = 2
_PR_SET_DUMPABLE = 4


class SandboxUnavailable(Exception):
    """The sandbox the worker is configured for cannot run here."""


@dataclass(frozen=True)
class SandboxConfig:
    bwrap: str = "auto"
    uid: str = "auto"
    root: str | None = None
    cgroup: str = "auto"
    #: folders a run without bubblewrap must not see: the worker's home (the embedded Redis's
    #: socket) and the folders of Redis or broker unix sockets (a network namespace does not cut
    #: those)
    hidden: tuple[str, ...] = ()

    @classmethod
    def from_env(cls) -> SandboxConfig:
        return cls.from_settings(Settings.from_env())

    @classmethod
    def from_settings(cls, settings: Settings) -> SandboxConfig:
        sockets = [_socket_folder(url or "") for url in (settings.redis_url, settings.broker_url)]
        return cls(
            bwrap=settings.sandbox_bwrap,
            uid=settings.sandbox_uid,
            root=settings.sandbox_dir,
            cgroup=settings.sandbox_cgroup,
            hidden=tuple(dict.fromkeys(p for p in [str(settings.home), *sockets] if p)),
        )


def _socket_folder(url: str) -> str | None:
    """The folder of a unix socket URL (`unix:///run/redis.sock`, `redis+socket://…`), else None."""
    scheme, _, rest = url.partition("://")
    if scheme not in ("unix", "redis+socket", "socket"):
        return None
    path = rest.split("?", 1)[0]
    return os.path.dirname(path) if path.startswith("/") else None


@dataclass
class SandboxRun:
    """A sandboxed run: the process result plus how it was confined."""

    process: ProcessResult
    isolation: str
    uid: int | None
    limits: Limits
    status: dict[str, object] = field(default_factory=dict)

    @property
    def meta(self) -> CallMeta:
        """How the run was confined, as the call's meta keeps it."""
        meta = CallMeta(
            isolation=self.isolation, uid=self.uid, limits=self.limits.model_dump(by_alias=True, exclude_none=True)
        )
        note, kills = self.status.get("uid_note"), self.status.get("oom_kills")
        if note:
            meta |= CallMeta(uid_note=str(note))
        meta |= CallMeta(memory_scope=str(self.status.get("memory_scope", "process")))
        if isinstance(kills, int) and kills:
            meta |= CallMeta(oom_kills=kills)
        return meta

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


def program_paths(argv: list[str]) -> list[str]:
    """What a sandboxed command cannot run without: its program and the files its declared argv
    names (the agent file's, not the model's)."""
    found = shutil.which(argv[0]) if argv else None
    return [*([found] if found else []), *(a for a in argv if os.path.isabs(a) and os.path.exists(a))]


def python_paths() -> list[str]:
    """What a child interpreter needs to import what this one imports."""
    package = Path(__file__).parent.parent  # celery_agents/, from celery_agents/tools/sandbox.py
    paths = [*python_install(), str(package.parent)]
    paths += [p for p in sys.path if p and os.path.exists(p)]
    return list(dict.fromkeys(os.path.abspath(p) for p in paths))


class Sandbox:
    """Runs argv confined; see the module docstring. One per worker process."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig.from_env()
        self._bwrap: str | bool | None = False  # False: not probed yet
        self._namespaces: bool | None = None  # None: not probed yet
        self._why_not: dict[str, str] = {}
        self.cgroups = Cgroups(self.config.cgroup)
        # This process holds the worker's secrets in its environment: no tool may read them.
        protect_process()

    # -- how a run is confined ---------------------------------------------------------------
    def _uid(self) -> int | None:
        """The uid of the next run: a fresh one when root, None to keep the worker's (not root)."""
        mode = self.config.uid
        if os.geteuid() != 0:
            return None if mode in ("off", "auto") else int(mode)
        if mode == "off":
            raise SandboxUnavailable(
                "AGENTS_SANDBOX_UID=off would run isolated calls as root: this worker runs none "
                "(set AGENTS_SANDBOX_UID=auto, or a uid of their own)"
            )
        return _UID_BASE + secrets.randbelow(_UID_SPAN) if mode == "auto" else int(mode)

    def bwrap(self) -> str | None:
        """The bwrap to use, probed once per process; None when runs go without it."""
        if self._bwrap is False:
            self._bwrap = None
            found = bwrap_path() if self.config.bwrap != "off" else None
            if self.config.bwrap == "off":
                self._why_not["bwrap"] = "bubblewrap is turned off (AGENTS_SANDBOX_BWRAP=off)"
            elif not found:
                self._why_not["bwrap"] = "bubblewrap is not installed (no bwrap on PATH)"
            else:
                true = shutil.which("true") or "/bin/true"
                probe = self._run([true], b"", {}, [], DEFAULT_LIMITS, 30.0, Wrap(found, [true], False), needs=[true])
                if probe.process.exit_status == 0:
                    self._bwrap = found
                else:
                    why = probe.process.stderr.decode(errors="replace").strip()
                    self._why_not["bwrap"] = f"bubblewrap cannot run here ({why})"
                    log.warning("bubblewrap is installed but cannot run here (%s)", why)
            if self._bwrap is None and self.config.bwrap == "require":
                raise SandboxUnavailable(
                    "bubblewrap is required (AGENTS_SANDBOX_BWRAP=require) but "
                    f"{'does not run here' if found else 'is not installed (bwrap)'}"
                )
        return self._bwrap  # type: ignore[return-value]

    def namespaces(self) -> bool:
        """Whether runs can go in namespaces of their own without bubblewrap (probed once)."""
        if self._namespaces is None:
            self._namespaces = False
            true = shutil.which("true") or "/bin/true"
            try:
                probe = self._run([true], b"", {}, [], DEFAULT_LIMITS, 30.0, None, needs=[true], isolate=True)
            except SandboxUnavailable as exc:
                self._why_not["namespaces"] = str(exc)
            else:
                self._namespaces = probe.process.exit_status == 0
                if not self._namespaces:
                    why = probe.process.stderr.decode(errors="replace").strip() or f"exit {probe.process.exit_status}"
                    self._why_not["namespaces"] = why
        return self._namespaces

    def containment(self) -> str | None:
        """How runs are contained here: `bwrap`, `namespaces`, or None (runs are refused)."""
        try:
            if self.bwrap():
                return "bwrap"
        except SandboxUnavailable:
            return None
        return "namespaces" if self.namespaces() else None

    def cannot_contain(self) -> str:
        """Why no run can be contained here, and what to install."""
        reasons = "; ".join(self._why_not.get(k, "") for k in ("bwrap", "namespaces") if self._why_not.get(k))
        return (
            f"this worker cannot contain isolated calls, so it runs none: {reasons}. Install bubblewrap "
            "(apt-get install bubblewrap) where it may create namespaces: allow unprivileged user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0), or run the worker "
            "as root with CAP_SYS_ADMIN (in a container: see docs/security.md)"
        )

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
        script); `readable`: everything it may read (bound read-only under bubblewrap). These come
        from the agent file, never from the model's arguments."""
        needed = list(needs)
        how = self.containment()
        if how is None:
            raise SandboxUnavailable(self.cannot_contain())
        seen = [*readable, *needed]
        wrap = Wrap(self.bwrap() or "", seen, network) if how == "bwrap" else None
        return self._run(
            list(argv),
            stdin,
            call_env,
            list(env_names),
            limits,
            timeout,
            wrap,
            needs=needed,
            isolate=wrap is None,
            network=network,
            readable=seen,
        )

    def _run(
        self,
        argv: list[str],
        stdin: bytes,
        call_env: dict[str, str],
        env_names: list[str],
        limits: Limits,
        timeout: float,
        wrap: Wrap | None,
        needs: list[str],
        grace: float = 1.0,
        isolate: bool = False,
        network: bool = False,
        readable: Sequence[str] = (),
    ) -> SandboxRun:
        uid = self._uid()
        drop_here = self._drop_here(uid, wrap, needs)
        workdir = tempfile.mkdtemp(prefix="agents-sandbox-", dir=self.config.root)
        if uid is not None and wrap is not None:
            argv = [sys.executable, "-I", "-S", "-B", CONFINE, "drop", str(uid), workdir, "--", *argv]
            wrap = Wrap(wrap.bwrap, [*wrap.readable, *python_install(), os.path.dirname(CONFINE)], wrap.network)
        processes = limits.processes
        if processes and (wrap is not None or isolate):
            processes += _RELAY_PROCESSES  # bubblewrap (or our relays) and pid 1 are in the cgroup too
        cgroup = self.cgroups.create(limits.memory_mb, processes)
        oom_kills = 0
        try:
            if uid is not None:
                os.chown(workdir, uid, uid)
            if wrap is not None:
                argv = bwrap_argv(wrap.bwrap, workdir, wrap.readable, wrap.network, as_root=os.geteuid() == 0) + argv
            cfg = {
                "argv": argv,
                "limits": rlimits(limits),
                "nproc_extra": uid is None,
                "uid": drop_here,
                "gid": drop_here,
                "timeout": timeout,
                "grace": grace,
                "cgroup_procs": cgroup.procs_files if cgroup else [],
                "namespaces": _namespaces(workdir, network, readable, self.config.hidden) if isolate else None,
            }
            env = sandbox_env(call_env, env_names, workdir)
            wait = timeout + grace + _BACKSTOP
            result, status = _supervised(cfg, stdin, env, workdir, limits.output_bytes or 1_000_000, wait, grace)
        finally:
            remove_run_dir(workdir)
            if cgroup is not None:
                oom_kills = cgroup.oom_kills()
                cgroup.remove()
        return _sandbox_run(result, status, wrap, uid, limits, cgroup is not None, oom_kills)

    @staticmethod
    def _drop_here(uid: int | None, wrap: Wrap | None, needs: list[str]) -> int | None:
        """The uid the supervisor drops to itself: none under bubblewrap, which runs as root and
        drops inside, where bound paths are reachable. Without it, every path the call needs must
        be readable by that uid."""
        if uid is None or wrap is not None:
            return None
        hidden = [p for p in needs if not reachable_by_others(p)]
        if hidden:
            raise SandboxUnavailable(
                f"cannot run this call as a uid of its own: {hidden[0]} is not readable by other users, "
                "and an isolated call never runs as root (install bubblewrap, or keep the tool and its "
                "interpreter in folders others can read)"
            )
        return uid


def _supervised(
    cfg: dict[str, object], stdin: bytes, env: dict[str, str], workdir: str, output_cap: int, wait: float, grace: float
) -> tuple[ProcessResult, dict[str, object]]:
    """Run the supervisor (confine.py) with `cfg`; its result and the status it wrote on its pipe.
    The supervisor enforces the call's timeout; this wait is the backstop."""
    status_r, status_w = os.pipe()
    try:
        launcher = [sys.executable, "-I", "-S", "-B", CONFINE, json.dumps({**cfg, "status_fd": status_w})]
        result = run_process(
            launcher,
            stdin,
            env=env,
            cwd=workdir,
            timeout=wait,
            output_cap=output_cap,
            grace=grace,
            pass_fds=(status_w,),
        )
        os.close(status_w)
        status_w = -1
        return result, _read_status(status_r)
    finally:
        if status_w >= 0:
            os.close(status_w)
        os.close(status_r)


def _sandbox_run(
    result: ProcessResult,
    status: dict[str, object],
    wrap: Wrap | None,
    uid: int | None,
    limits: Limits,
    run_cgroup: bool,
    oom_kills: int,
) -> SandboxRun:
    """What the run gave, with the exit status and timeout the supervisor saw."""
    if status:
        result.exit_status = status.get("exit_status")  # type: ignore[assignment]
        result.timed_out = result.timed_out or bool(status.get("timed_out"))
    if wrap is not None and result.exit_status is not None and 128 < result.exit_status <= 128 + 64:
        # bwrap's init reports a tool killed by signal N as exit status 128 + N.
        result.exit_status = 128 - result.exit_status
    status["memory_scope"] = "run" if run_cgroup else "process"
    if run_cgroup and oom_kills:
        status["oom_kills"] = oom_kills
    return SandboxRun(result, "bwrap" if wrap else "namespaces", uid, limits, status)


@dataclass(frozen=True)
class Wrap:
    """A run under bubblewrap: which bwrap, what it may read, whether it keeps the network."""

    bwrap: str
    readable: list[str]
    network: bool


def _namespaces(workdir: str, network: bool, keep: Sequence[str], hidden: Sequence[str]) -> dict[str, object]:
    """What `confine.py` sets up without bubblewrap: the folder holding the run directories, /tmp
    and the worker's own folders hidden but for this run's directory and the files the tool needs."""
    folders = [os.path.dirname(workdir), *(h for h in hidden if h != "/" and os.path.isdir(h))]
    return {
        "user": os.geteuid() != 0,
        "network": network,
        "workdir": workdir,
        "hide": list(dict.fromkeys(folders)),
        "keep": list(dict.fromkeys(os.path.abspath(p) for p in keep)),
    }


def protect_process() -> None:
    """Make this process's memory and `/proc/<pid>/environ` unreadable to processes of the same
    uid (PR_SET_DUMPABLE 0): a tool running as the worker's user cannot read the worker's keys.
    Inherited by forked children (the pool), reset by exec (tools are not protected from us)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: nothing to do
        pass


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
