"""Running one child process for a tool: stdin fed, output read with a cap, a wall-clock timeout.

The child leads its own process group. At the timeout the whole group gets SIGTERM, then SIGKILL
after a grace period (so a child that ignores SIGTERM dies too); when the leader exits, whatever it
left in its group is killed at once. Output beyond the cap is read and dropped, so a chatty tool
neither blocks on a full pipe nor fills the worker's memory.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Protocol

from celery_agents.tools.cancel import cancelled

STDERR_CAP = 64 * 1024
#: after the leader exits, how long descendants' last output is still read
_DRAIN_SECONDS = 1.0
_CHUNK = 64 * 1024


@dataclass
class ProcessResult:
    """How a run ended. `exit_status` is negative (-N) when signal N killed the leader and None
    when it never started."""

    exit_status: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool
    duration_ms: float
    stdout_bytes: int = 0

    @property
    def stdout_truncated(self) -> bool:
        return self.stdout_bytes > len(self.stdout)


class Leader(Protocol):
    """A tool's process as it is supervised: a `subprocess.Popen`, or a call forked by the fork
    server (forkserver.py `ForkedCall`), which is not this process's child."""

    pid: int
    stdin: IO[bytes] | None
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class _Pump:
    """Feeds stdin and collects stdout (first `cap` bytes) and stderr (last `err_cap` bytes)."""

    def __init__(self, proc: Leader, stdin: bytes, cap: int, err_cap: int) -> None:
        self.sel = selectors.DefaultSelector()
        self.cap, self.err_cap = cap, err_cap
        self.out = bytearray()
        self.err = bytearray()
        self.out_total = 0
        self.pending = memoryview(stdin)
        assert proc.stdin and proc.stdout and proc.stderr
        self.stdin = proc.stdin
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            os.set_blocking(stream.fileno(), False)
        if stdin:
            self.sel.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        self.sel.register(proc.stdout, selectors.EVENT_READ, "out")
        self.sel.register(proc.stderr, selectors.EVENT_READ, "err")
        # A pidfd turns readable when the leader exits: no polling for the exit. A forked call's
        # reaper says so on a pipe of its own (`exit_fd`), which this does not close.
        self.pidfd: int | None = None
        self.owns_pidfd = True
        try:
            exit_fd = getattr(proc, "exit_fd", None)
            self.pidfd, self.owns_pidfd = (exit_fd, False) if exit_fd is not None else (os.pidfd_open(proc.pid), True)
            self.sel.register(self.pidfd, selectors.EVENT_READ, "exit")
        except (AttributeError, OSError):
            self.pidfd = None

    @property
    def reading(self) -> bool:
        return any(key.data in ("out", "err") for key in self.sel.get_map().values())

    @property
    def poll_interval(self) -> float:
        return 0.5 if self.pidfd is not None else 0.05

    def wait(self, timeout: float) -> None:
        if not self.sel.get_map():
            time.sleep(max(0.0, min(timeout, 0.05)))
            return
        for key, _ in self.sel.select(max(0.0, timeout)):
            if key.data is None:
                self._write(key.fileobj)
            elif key.data == "exit":
                self._close_pidfd()
            else:
                self._read(key.fileobj, key.data)

    def _close_pidfd(self) -> None:
        if self.pidfd is not None:
            self.sel.unregister(self.pidfd)
            if self.owns_pidfd:
                os.close(self.pidfd)
            self.pidfd = None

    def _write(self, stream: object) -> None:
        try:
            n = os.write(self.stdin.fileno(), self.pending[:_CHUNK])
        except BlockingIOError:
            return
        except (BrokenPipeError, OSError):
            n = len(self.pending)
        self.pending = self.pending[n:]
        if not self.pending:
            self.sel.unregister(self.stdin)
            self.stdin.close()

    def _read(self, stream: object, which: str) -> None:
        fd = stream.fileno()  # type: ignore[attr-defined]
        try:
            data = os.read(fd, _CHUNK)
        except BlockingIOError:
            return
        if not data:
            self.sel.unregister(stream)  # type: ignore[arg-type]
            stream.close()  # type: ignore[attr-defined]
            return
        if which == "out":
            self.out_total += len(data)
            room = self.cap - len(self.out)
            if room > 0:
                self.out += data[:room]
        else:
            self.err += data
            if len(self.err) > 2 * self.err_cap:
                del self.err[: len(self.err) - self.err_cap]

    def close(self) -> None:
        self._close_pidfd()
        for key in list(self.sel.get_map().values()):
            self.sel.unregister(key.fileobj)
            key.fileobj.close()  # type: ignore[union-attr]
        if not self.stdin.closed:
            self.stdin.close()
        self.sel.close()


def _leader_exited(proc: Leader) -> bool:
    """Whether the leader has exited, without reaping it: its pid keeps naming the group."""
    if proc.returncode is not None:
        return True
    if not isinstance(proc, subprocess.Popen):  # not our child: its reaper says
        return proc.poll() is not None
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _running_members(pgid: int) -> bool:
    """Whether a member of the group is still running (zombies waiting for their reaper do not count)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _group_running(pgid: int) -> bool:
    return _group_alive(pgid) and (not os.path.isdir("/proc/self") or _running_members(pgid))


def _await_group_gone(pgid: int, seconds: float) -> None:
    """Wait (briefly) until the killed members of the group are gone: SIGKILL is asynchronous."""
    end = time.monotonic() + seconds
    while _group_running(pgid) and time.monotonic() < end:
        time.sleep(0.005)


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def kill_group(proc: Leader, grace: float = 1.0) -> None:
    """SIGTERM the process group; SIGKILL it when anything is left after `grace` seconds."""
    pgid = proc.pid
    signal_group(pgid, signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end:
        proc.poll()
        if proc.returncode is not None and not _group_running(pgid):
            return
        time.sleep(0.02)
    signal_group(pgid, signal.SIGKILL)
    proc.wait()


def run_process(
    argv: Sequence[str],
    stdin: bytes,
    *,
    env: dict[str, str],
    cwd: str | None,
    timeout: float,
    output_cap: int,
    stderr_cap: int = STDERR_CAP,
    grace: float = 1.0,
    pass_fds: Sequence[int] = (),
) -> ProcessResult:
    """Run argv in its own session and process group; see the module docstring."""
    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=cwd,
            start_new_session=True,
            pass_fds=tuple(pass_fds),
        )
    except OSError as exc:
        return ProcessResult(
            None,
            b"",
            f"cannot start {argv[0]!r}: {exc.strerror or exc}".encode(),
            False,
            (time.monotonic() - started) * 1000,
        )
    return supervise(proc, stdin, started, timeout=timeout, output_cap=output_cap, stderr_cap=stderr_cap, grace=grace)


def supervise(
    proc: Leader,
    stdin: bytes,
    started: float,
    *,
    timeout: float,
    output_cap: int,
    stderr_cap: int = STDERR_CAP,
    grace: float = 1.0,
) -> ProcessResult:
    """Feed, read and watch a started process until it ends, its timeout or a cancel."""
    pump = _Pump(proc, stdin, output_cap, stderr_cap)
    try:
        timed_out = _watch(proc, pump, started + timeout, grace)
    finally:
        pump.close()
        if proc.returncode is None and not _leader_exited(proc):
            kill_group(proc, 0)
        proc.wait()
        _await_group_gone(proc.pid, _DRAIN_SECONDS)
    return ProcessResult(
        proc.returncode,
        bytes(pump.out),
        bytes(pump.err[-stderr_cap:]),
        timed_out,
        (time.monotonic() - started) * 1000,
        pump.out_total,
    )


def _watch(proc: Leader, pump: _Pump, deadline: float, grace: float) -> bool:
    """Pump the tool's output until it ends, its deadline passes or the call is cancelled (then its
    group is killed), and drain what it wrote a moment longer. True when the deadline passed."""
    timed_out = False
    drain_end: float | None = None
    while True:
        now = time.monotonic()
        if drain_end is None:
            if now >= deadline or cancelled():
                timed_out = now >= deadline
                kill_group(proc, grace)
                drain_end = time.monotonic() + _DRAIN_SECONDS
            elif _leader_exited(proc):
                # Children the tool left behind in its group must not outlive the call.
                signal_group(proc.pid, signal.SIGKILL)
                drain_end = now + _DRAIN_SECONDS
        if drain_end is not None and (not pump.reading or time.monotonic() >= drain_end):
            return timed_out
        limit = (drain_end if drain_end is not None else deadline) - time.monotonic()
        pump.wait(min(limit, pump.poll_interval))
