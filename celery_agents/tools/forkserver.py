"""A fork server for python tool calls (runSync, runAsync): one per worker process, so that a call
costs a fork, not an interpreter's start and the imports binding its arguments needs.

The server is a child interpreter started on first use with the allow-listed environment only
(`PATH`, `HOME`, `LANG`, `LC_ALL`, `TZ`: command.py `TOOL_ENV`), never the worker's: it holds no key,
and having imported this module (pydantic with it) it waits on a socket. For each call the worker
sends it, over that socket, the ends of four pipes (the call's stdin, stdout, stderr, and a status
pipe); the server forks, says the child's pid on the status pipe, and later its exit status. The
child makes itself a session and process-group leader, reads its request from its stdin (the
server never reads it, so one call's variables never pass through the memory the next call is
forked from), sets the call's environment, working directory and import path, and calls the
function as a child interpreter would (python_call.py `child_main`). The tool's module is
imported in the child, never in the server.

The worker supervises a forked call as any child process (process.py): output read with a cap, the
process group killed at the timeout. The server leaves when the worker closes its end of the socket
(the worker process ended). A worker process that cannot start one runs each call in a fresh
interpreter instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from typing import IO

#: what the server interpreter runs (`python -I -B -c SERVER_BOOTSTRAP <fd> <path>...`)
SERVER_BOOTSTRAP = (
    "import sys; sys.path[:0] = sys.argv[2:]; from celery_agents.tools.forkserver import serve; serve(int(sys.argv[1]))"
)


def serve(fd: int) -> None:
    """The server's loop: fork a child for each call received on socket `fd`; report each
    child's pid and exit status on the call's status pipe. Leaves when the socket closes."""
    from celery_agents.tools import python_call  # noqa: F401 - imported once, here: the children fork with it
    from celery_agents.tools.sandbox import protect_process

    protect_process()  # a tool (same uid) cannot trace the process every later call is forked from
    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    status: dict[int, int] = {}
    while True:
        ready, _, _ = select.select([fd, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(status)
        if fd in ready:
            try:
                msg, fds, _, _ = socket.recv_fds(sock, 16, 4)
            except OSError:
                msg, fds = b"", []
            if not msg:
                return  # the worker process is gone
            if len(fds) == 4:
                _fork(fds, status, (fd, wake_r, wake_w))
            else:
                for extra in fds:
                    os.close(extra)


def _fork(fds: list[int], status: dict[int, int], server_fds: tuple[int, ...]) -> None:
    stdin, stdout, stderr, report = fds
    pid = os.fork()
    if pid == 0:  # the call's process
        try:
            _child(stdin, stdout, stderr, (report, *server_fds))
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(1)
    for used in (stdin, stdout, stderr):
        os.close(used)
    status[pid] = report
    with contextlib.suppress(OSError):
        os.write(report, f"{pid}\n".encode())


def _reap(status: dict[int, int]) -> None:
    while True:
        try:
            pid, how = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        report = status.pop(pid, None)
        if report is not None:
            with contextlib.suppress(OSError):
                os.write(report, f"{os.waitstatus_to_exitcode(how)}\n".encode())
            os.close(report)


def _child(stdin: int, stdout: int, stderr: int, close: tuple[int, ...]) -> None:
    """In the forked call: become what `python -I -c CHILD_BOOTSTRAP` would have been, then call."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    os.setsid()
    for target, source in ((0, stdin), (1, stdout), (2, stderr)):
        os.dup2(source, target)
    for fd in (stdin, stdout, stderr, *close):
        with contextlib.suppress(OSError):
            os.close(fd)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - fd 0 outlives it
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    with open(0, "rb", closefd=False) as raw:
        request = json.loads(raw.read())
    os.environ.clear()
    os.environ.update(request.get("env") or {})
    if request.get("cwd"):
        os.chdir(request["cwd"])
    sys.path[:0] = request["path"]
    from celery_agents.tools.python_call import child_main

    child_main(request)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class ForkedCall:
    """A call's process as the worker supervises it (the part of `subprocess.Popen` process.py
    uses): its pipes, its pid, and its exit status as the server reports it."""

    stdin: IO[bytes] | None
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def __init__(self, stdin: IO[bytes], stdout: IO[bytes], stderr: IO[bytes], report: int) -> None:
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self._report = report
        self._said = b""
        self.returncode: int | None = None
        line = self._line(timeout=30.0)
        if line is None:
            self._close_report()
            raise OSError("the fork server did not start the call")
        self.pid = int(line)

    def _line(self, timeout: float | None) -> bytes | None:
        """The next line on the status pipe, waiting up to `timeout` (None: for ever)."""
        while b"\n" not in self._said:
            ready, _, _ = select.select([self._report], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(self._report, 64)
            if not chunk:  # the server is gone: the status will never come
                return None
            self._said += chunk
        line, _, self._said = self._said.partition(b"\n")
        return line

    @property
    def exit_fd(self) -> int:
        """Readable once the server says the call's exit status (its pid was said already)."""
        return self._report

    def poll(self) -> int | None:
        if self.returncode is None and self._report >= 0:
            line = self._line(timeout=0)
            if line is None and not _exists(self.pid):
                # Reaped: the server says its status next (or, gone itself, never: then 1).
                line = self._line(timeout=5.0) or b"1"
            if line is not None:
                self.returncode = int(line)
                self._close_report()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and self._report >= 0:
            line = self._line(timeout)
            if line is not None:
                self.returncode = int(line)
            elif timeout is not None and _exists(self.pid):
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            else:
                self.returncode = 1
            self._close_report()
        return self.returncode if self.returncode is not None else 1

    def _close_report(self) -> None:
        if self._report >= 0:
            os.close(self._report)
            self._report = -1


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ForkServer:
    """This process's fork server, started on first use (again if it died); `start(path, env)`
    starts a call's process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid = 0

    def _server(self, path: list[str], env: dict[str, str]) -> socket.socket:
        if self._sock is not None and self._pid == os.getpid() and self._proc and self._proc.poll() is None:
            return self._sock
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-c", SERVER_BOOTSTRAP, str(theirs.fileno()), *path],
                env=env,
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        finally:
            theirs.close()
        self._sock, self._pid = mine, os.getpid()
        return mine

    def start(self, path: list[str], env: dict[str, str]) -> ForkedCall:
        """A new call's process, its request yet to be written to its stdin. `path`: the import
        path the server starts with; `env`: the server's own (allow-listed) environment."""
        pipes = [os.pipe() for _ in range(4)]  # stdin, stdout, stderr, status
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][1]]
        try:
            with self._lock:
                try:
                    socket.send_fds(self._server(path, env), [b"call"], theirs)
                except OSError:  # a server that died: one more try with a fresh one
                    self._sock = None
                    socket.send_fds(self._server(path, env), [b"call"], theirs)
        except BaseException:
            for fd in (pipes[0][1], pipes[1][0], pipes[2][0], pipes[3][0]):
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        return ForkedCall(
            os.fdopen(pipes[0][1], "wb"), os.fdopen(pipes[1][0], "rb"), os.fdopen(pipes[2][0], "rb"), pipes[3][0]
        )


_server = ForkServer()


def fork_server() -> ForkServer:
    """This process's fork server (one, whatever the number of threads calling tools)."""
    return _server
