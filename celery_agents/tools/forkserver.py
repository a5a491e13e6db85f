"""Fork servers for python tool calls (runSync, runAsync), so that a call costs a fork, not an
interpreter's start, nor the import of the tool's module at each call.

A worker process keeps one server per tool module (and import path and environment), up to
`WARM_SERVERS`, the least recently used retired past that. A server is a child interpreter started
on a module's first call with the allow-listed environment (`PATH`, `HOME`, `LANG`, `LC_ALL`, `TZ`:
command.py `TOOL_ENV`) and the variables the tool names (`env`, `AGENTS_TOOL_ENV`), never the
worker's: it holds no key of the worker's. It imports this module (pydantic with it) and the tool's
module, then waits on a socket; before each call it makes the argument model of the function
called (tools/signature.py `signature_model`), once per function, so a call's process finds both
made. For each call the worker sends it, over that socket, the function's name and the ends of four
pipes (the call's stdin, stdout, stderr, and a status pipe); the server forks, says the child's pid
on the status pipe, and later its exit status. The child makes itself a session and process-group
leader, reads its request from its stdin (the server never reads it, so one call's variables never
pass through the memory the next call is forked from), sets the call's environment, working
directory and import path, and calls the function as a child interpreter would (python_call.py
`child_main`).

One module per server: a module's import-time code runs in the process its own calls are forked
from, never in another tool's. Before each call the server looks at the files of the modules the
tool's import brought in (the standard library's aside): one changed since, and it imports them
again, so an edited tool is what runs. A module that failed to import is forgotten (each call's
process imports it and says why) and tried again at the next call. Per-call variables
(`AGENTS_SESSION_ID`, `AGENTS_CALL_ID`, ...) are the call's, not the import's: a module reads them
inside its function.

The worker supervises a forked call as any child process (process.py): output read with a cap, the
process group killed at the timeout. A server leaves when the worker closes its end of the socket
(the worker process ended, or the server was retired) once the calls it forked have ended. A
worker process that cannot start one runs each call in a fresh interpreter instead.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import traceback
from typing import IO

#: what the server interpreter runs (`python -I -B -c SERVER_BOOTSTRAP <fd> <module> <path>...`)
SERVER_BOOTSTRAP = (
    "import sys; sys.path[:0] = sys.argv[3:]; from celery_agents.tools.forkserver import serve; "
    "serve(int(sys.argv[1]), sys.argv[2])"
)
#: the warm servers a worker process keeps (one per tool module), the least recently used retired
WARM_SERVERS = 16
#: the longest function name a call's message carries (a longer one is not made ready ahead)
_NAME_BYTES = 512


def serve(fd: int, module: str = "") -> None:
    """The server's loop: fork a child for each call received on socket `fd`, `module` imported
    (and again when edited) before; report each child's pid and exit status on the call's status
    pipe. Leaves when the socket closes, once the children it forked have ended."""
    from celery_agents.tools import python_call  # noqa: F401 - imported once, here: the children fork with it
    from celery_agents.tools.sandbox import protect_process

    protect_process()  # a tool (same uid) cannot trace the process every later call is forked from
    warm = Warm(module) if module else None
    if warm is not None:
        warm.check_threads()
    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    status: dict[int, int] = {}
    watched = [fd, wake_r]
    while fd in watched or status:
        ready, _, _ = select.select(watched, [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(status)
        if fd in ready:
            try:
                msg, fds, _, _ = socket.recv_fds(sock, 8 + _NAME_BYTES, 4)
            except OSError:
                msg, fds = b"", []
            if not msg:  # the worker process is gone, or retired this server: its calls finish
                watched.remove(fd)
                _reap(status)
                continue
            if len(fds) == 4:
                if warm is not None:
                    warm.ready(msg.partition(b" ")[2].decode(errors="replace"))
                    if not status:  # a call in flight would lose its exit status
                        warm.check_threads()
                _fork(fds, status, (fd, wake_r, wake_w))
            else:
                for extra in fds:
                    os.close(extra)


#: where the standard library is: its modules are not watched for edits
_STDLIB = tuple({sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")})


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _threads() -> int:
    """The threads of this process, native ones included."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


class Warm:
    """In a server: the tool module its calls are forked with, and the argument models of the
    functions called; imported again when one of its files changed."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.names: set[str] = set()
        self.files: dict[str, tuple[int, int] | None] = {}
        self.functions: set[str] = set()
        self.loaded = False
        self._load()

    def _load(self) -> None:
        before = set(sys.modules)
        try:
            importlib.import_module(self.module)
            self.loaded = True
        except BaseException:  # a call's process imports it again and says why
            self.loaded = False
        self.names = set(sys.modules) - before
        self.files = {}
        for name in self.names:
            path = getattr(sys.modules.get(name), "__file__", None)
            if isinstance(path, str) and not path.startswith(_STDLIB):
                self.files[path] = _stamp(path)
        self.functions = set()
        if not self.loaded:
            self._forget()

    def check_threads(self) -> None:
        """A module whose import started a thread is not forked from: a lock that thread held at
        the fork would stay held in the call's process for ever. The server then becomes one that
        imports no module (the same process, started again, with no call in flight), each call
        importing it."""
        if _threads() > 1:
            sys.stdout.flush()
            os.execv(
                sys.executable, [sys.executable, "-I", "-B", "-c", SERVER_BOOTSTRAP, sys.argv[1], "", *sys.argv[3:]]
            )

    def _forget(self) -> None:
        for name in self.names:
            sys.modules.pop(name, None)
        importlib.invalidate_caches()

    def ready(self, function: str) -> None:
        """Before a call of `function`: the module as its files are now, the function's argument
        model made (once per function)."""
        if not self.loaded or any(_stamp(path) != stamp for path, stamp in self.files.items()):
            if self.loaded:
                self._forget()
            self._load()
        if self.loaded and function and function not in self.functions:
            self.functions.add(function)
            with contextlib.suppress(Exception):  # the call's process says what is wrong
                from celery_agents.tools.signature import load_function, signature_model

                signature_model(load_function(f"{self.module}:{function}"))


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
    """A fork server of this process, started on first use (again if it died); `start(path, env)`
    starts a call's process. `module`: the tool module it imports for its calls ("" for none)."""

    def __init__(self, module: str = "") -> None:
        self.module = module
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid = 0
        self._closed = False

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (for this process), else None."""
        proc = self._proc
        return proc.pid if proc is not None and self._pid == os.getpid() and proc.poll() is None else None

    def _server(self, path: list[str], env: dict[str, str]) -> socket.socket:
        if self._closed:
            raise OSError("the fork server was retired")
        if self._sock is not None and self._pid == os.getpid() and self._proc and self._proc.poll() is None:
            return self._sock
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-c", SERVER_BOOTSTRAP, str(theirs.fileno()), self.module, *path],
                env=env,
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        finally:
            theirs.close()
        self._sock, self._pid = mine, os.getpid()
        return mine

    def start(self, path: list[str], env: dict[str, str], function: str = "") -> ForkedCall:
        """A new call's process, its request yet to be written to its stdin. `path`: the import
        path the server starts with; `env`: the server's own (allow-listed) environment;
        `function`: the name, in the server's module, of the function called."""
        name = function.encode()
        message = b"call " + name if len(name) <= _NAME_BYTES else b"call"
        pipes = [os.pipe() for _ in range(4)]  # stdin, stdout, stderr, status
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][1]]
        try:
            with self._lock:
                try:
                    socket.send_fds(self._server(path, env), [message], theirs)
                except OSError:  # a server that died: one more try with a fresh one
                    self._sock = None
                    socket.send_fds(self._server(path, env), [message], theirs)
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

    def close(self) -> None:
        """Retire the server: it takes no more calls and leaves once those it forked have ended."""
        with self._lock:
            self._closed = True
            if self._sock is not None:
                self._sock.close()
                self._sock = None


_server = ForkServer()
_warm: collections.OrderedDict[tuple[str, tuple[str, ...], tuple[tuple[str, str], ...]], ForkServer] = (
    collections.OrderedDict()
)
_warm_lock = threading.Lock()


def _forget_after_fork() -> None:
    """A forked worker process starts servers of its own (its parent's are not its children)."""
    global _warm_lock, _server
    _warm_lock, _server = threading.Lock(), ForkServer()
    _warm.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def fork_server() -> ForkServer:
    """This process's fork server that imports no tool module."""
    return _server


def warm_server(module: str, path: list[str], env: dict[str, str]) -> ForkServer:
    """This process's fork server for the tool module `module`, imported with import path `path`
    and environment `env` (started on its first call); the least recently used one retired past
    `WARM_SERVERS`."""
    key = (module, tuple(path), tuple(sorted(env.items())))
    with _warm_lock:
        server = _warm.get(key)
        if server is not None:
            _warm.move_to_end(key)
            return server
        server = _warm[key] = ForkServer(module)
        retired = [_warm.popitem(last=False)[1] for _ in range(len(_warm) - max(1, WARM_SERVERS))]
    for old in retired:
        old.close()
    return server


def warm_servers() -> list[ForkServer]:
    """This process's warm servers, the least recently used first."""
    with _warm_lock:
        return list(_warm.values())
