"""Fork servers for python tool calls (runSync, runAsync), so that a call costs a fork, not an
interpreter's start, nor the import of the tool's module at each call.

A worker process keeps one **warm** server per tool module (and import path, environment and
working directory), up to `WARM_SERVERS`; one unused for `IDLE_SECONDS` is retired at the next
python call, and a module that finds no room is served by the **plain** server, one per worker process, which imports no
tool module (each call's process imports it). Every server is a child interpreter started with the
allow-listed environment only (`PATH`, `HOME`, `LANG`, `LC_ALL`, `TZ`: command.py `TOOL_ENV`),
never the worker's; it makes itself unreadable to other processes of its uid (`protect_process`)
before anything else. A warm server then receives the tool's own variables (`env`,
`AGENTS_TOOL_ENV`) over its socket, imports the module in the agent file's folder, its output to
/dev/null, and says whether it can be forked from, with the files the import brought in: not when
the import failed, started a Python thread (a lock it held at the fork would stay held in the
call's process) or left a file or connection open (every call would share it); then the module is served
by the plain server for `COLD_SECONDS`, or until one of those files changes. A warm server also
builds the argument model of each function called, once (tools/signature.py `signature_model`).

For each call the worker sends the server, over its socket, the function's name and the ends of
four pipes (the call's stdin, stdout, stderr, and a status pipe); the server forks, says the
child's pid on the status pipe, and later its exit status. The child makes itself a session and
process-group leader, reads its request from its stdin (the server never reads it, so one call's
variables never pass through the memory the next call is forked from), sets the call's
environment, working directory and import path, and calls the function as a child interpreter
would (python_call.py `child_main`).

One module per warm server: a module's import-time code runs in the process its own calls are
forked from, never in another tool's. A server never imports a module twice: before each call the
worker looks at the files of the modules its import brought in (not those of the standard library
or of installed packages: an upgrade takes a worker's restart), and when one changed it retires
that server and starts another, so an edited tool is what runs. Per-call variables
(`AGENTS_SESSION_ID`, `AGENTS_CALL_ID`, ...) are the call's, not the import's: a module reads them
inside its function; state made at import (a `random.Random()`, a cache) starts equal in every
call.

The worker supervises a forked call as any child process (process.py): output read with a cap, the
process group killed at the timeout. A server leaves when the worker closes its end of the socket
(the worker process ended, or the server was retired) once the calls it forked have ended. A warm
server not ready within the call's timeout (its import hangs) is killed. A call's process holds
only its own pipes, none of the server's other calls. A worker process that
cannot start a server runs each call in a fresh interpreter instead.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import importlib.util
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import traceback
from typing import IO

log = logging.getLogger(__name__)

#: what the server interpreter runs (`python -I -B -c SERVER_BOOTSTRAP <fd> <module> <path>...`)
SERVER_BOOTSTRAP = (
    "import sys; sys.path[:0] = sys.argv[3:]; from celery_agents.tools.forkserver import serve; "
    "serve(int(sys.argv[1]), sys.argv[2])"
)
#: the warm servers a worker process keeps at most (one per tool module); past that, the plain one
WARM_SERVERS = 8
#: a warm server unused this long is retired, making room
IDLE_SECONDS = 600.0
#: a module whose server could not be forked from is served by the plain server this long (or
#: until one of its files changes)
COLD_SECONDS = 120.0
#: the longest function name a call's message carries (a longer one is not made ready ahead)
_NAME_BYTES = 512
#: the largest message a warm server's socket carries (the tool's variables, its files)
_MESSAGE_BYTES = 1 << 20
#: past every descriptor a call's process may have inherited (closed in it from 3 up)
_MAX_FD = 1 << 16
#: signals whose handlers a module may set at import, kept in its calls' processes
_KEPT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def serve(fd: int, module: str = "") -> None:
    """The server's loop: fork a child for each call received on socket `fd`; report each
    child's pid and exit status on the call's status pipe. Leaves when the socket closes, once the
    children it forked have ended. With `module`, a warm server: imports it first (`_warm_up`),
    and leaves at once when it cannot be forked from."""
    from celery_agents.tools.sandbox import protect_process

    protect_process()  # a tool (same uid) cannot trace the process every later call is forked from
    from celery_agents.tools import python_call  # noqa: F401 - imported once, here: the children fork with it

    os.set_inheritable(fd, False)  # nothing the module starts gets the worker's socket
    sock = socket.socket(fileno=fd)
    handlers: dict[int, object] = {}
    if module:
        warm = _warm_up(sock, module)
        if warm is None:
            return
        handlers = warm
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    status: dict[int, int] = {}
    made: set[str] = set()
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
            for received in fds:
                os.set_inheritable(received, False)
            if len(fds) == 4:
                if module:
                    _make_ready(module, msg.partition(b" ")[2].decode(errors="replace"), made)
                _fork(fds, status, (fd, wake_r, wake_w), handlers)
            else:
                for extra in fds:
                    os.close(extra)


#: where the standard library and installed packages are: their modules are not watched for edits
_INSTALLED = tuple({sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")} - {None, ""})
#: the most files of a module's import watched for edits
_WATCHED_FILES = 500


def _stamp(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_mtime_ns, st.st_size]


def _installed(path: str) -> bool:
    """Part of the standard library or of an installed package (`site-packages`, `dist-packages`)."""
    return path.startswith(_INSTALLED) or "/site-packages/" in path or "/dist-packages/" in path


def _threads() -> int:
    """The Python threads of this process. Native ones are not counted: the thread pools of
    numerical libraries (OpenBLAS, MKL) are made safe to fork by the libraries themselves, and
    forking with them is what `multiprocessing` does by default on Linux."""
    return threading.active_count()


def _open_fds() -> set[int]:
    try:
        return {int(n) for n in os.listdir("/proc/self/fd")}
    except OSError:
        return set()


def _warm_up(sock: socket.socket, module: str) -> dict[int, object] | None:
    """In a warm server: take the tool's variables, import `module`, and tell the worker whether
    calls can be forked from here (`{"warm": bool, "why": str, "files": {path: stamp}}`); the
    signal handlers the import set when they can, else None (the server leaves)."""
    message = sock.recv(_MESSAGE_BYTES)
    if not message.startswith(b"env "):
        return None
    os.environ.update(json.loads(message[4:]))
    before_modules, before_fds, before_threads = set(sys.modules), _open_fds(), _threads()
    before_handlers = {sig: signal.getsignal(sig) for sig in _KEPT_SIGNALS}
    why = ""
    try:
        importlib.import_module(module)
    except BaseException as exc:  # a call's process imports it again and says why
        why = f"its import failed: {type(exc).__name__}"
    files: dict[str, list[int] | None] = {}
    for name in set(sys.modules) - before_modules:
        path = getattr(sys.modules.get(name), "__file__", None)
        if isinstance(path, str) and not _installed(path) and len(files) < _WATCHED_FILES:
            files[path] = _stamp(path)
    with contextlib.suppress(Exception):  # the module's own file, when its import failed
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.origin and os.path.exists(spec.origin):
            files[spec.origin] = _stamp(spec.origin)
    if not why and _threads() > before_threads:
        why = "its import started a thread"
    if not why and _open_fds() - before_fds - {sock.fileno()}:
        why = "its import left a file or connection open"
    try:
        sock.send(json.dumps({"warm": not why, "why": why, "files": files}).encode())
    except OSError:
        return None
    if why:
        return None
    after = {sig: signal.getsignal(sig) for sig in _KEPT_SIGNALS}
    return {sig: h for sig, h in after.items() if h is not before_handlers[sig] and h is not None}


def _make_ready(module: str, function: str, made: set[str]) -> None:
    """Before a call of `function`: its argument model made, once per function."""
    if function and function not in made:
        made.add(function)
        with contextlib.suppress(Exception):  # the call's process says what is wrong
            from celery_agents.tools.signature import load_function, signature_model

            signature_model(load_function(f"{module}:{function}"))


def _fork(fds: list[int], status: dict[int, int], server_fds: tuple[int, ...], handlers: dict[int, object]) -> None:
    stdin, stdout, stderr, report = fds
    pid = os.fork()
    if pid == 0:  # the call's process
        try:
            _child(stdin, stdout, stderr, (report, *server_fds), handlers)
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


def _child(stdin: int, stdout: int, stderr: int, close: tuple[int, ...], handlers: dict[int, object]) -> None:
    """In the forked call: become what `python -I -c CHILD_BOOTSTRAP` would have been, then call.
    `handlers`: the signal handlers the tool's module set at import (a warm server's), kept."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    for kept, handler in handlers.items():
        signal.signal(kept, handler)  # type: ignore[arg-type]
    os.setsid()
    for target, source in ((0, stdin), (1, stdout), (2, stderr)):
        os.dup2(source, target)
    for fd in (stdin, stdout, stderr, *close):
        with contextlib.suppress(OSError):
            os.close(fd)
    # Nor the status pipes of the server's other calls: a call that wrote to one would end that
    # call in its worker's eyes (and have its process group killed).
    os.closerange(3, _MAX_FD)
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


class Retired(OSError):
    """The server was retired (its module edited, or unused) while a call was being handed to it."""


class NotWarm(OSError):
    """A warm server that cannot be forked from (`why`); `files`: what its module's import read."""

    def __init__(self, why: str, files: dict[str, list[int] | None] | None = None) -> None:
        super().__init__(why)
        self.why, self.files = why, files or {}


class ForkServer:
    """A fork server of this process, started on first use (again if it died); `start(path, env)`
    starts a call's process. `module`: the tool module a warm server imports ("" for the plain
    server), in `cwd`, with the tool's variables `tool_env`."""

    def __init__(self, module: str = "", cwd: str | None = None, tool_env: dict[str, str] | None = None) -> None:
        self.module, self.cwd, self.tool_env = module, cwd, tool_env or {}
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid = 0
        self._closed = False
        #: the files the module's import read, as they were (a warm server's)
        self.files: dict[str, list[int] | None] = {}
        self.used = time.monotonic()

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (for this process), else None."""
        proc = self._proc
        return proc.pid if proc is not None and self._pid == os.getpid() and proc.poll() is None else None

    def stale(self) -> bool:
        """A file its module's import read changed since."""
        return any(_stamp(path) != stamp for path, stamp in self.files.items())

    def _server(self, path: list[str], env: dict[str, str], ready_within: float) -> socket.socket:
        if self._closed:
            raise Retired("the fork server was retired")
        if self._sock is not None and self._pid == os.getpid() and self._proc and self._proc.poll() is None:
            return self._sock
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        quiet = subprocess.DEVNULL if self.module else None  # a module's prints are not the worker's
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-c", SERVER_BOOTSTRAP, str(theirs.fileno()), self.module, *path],
                env=env,
                cwd=self.cwd if self.module and self.cwd and os.path.isdir(self.cwd) else None,
                stdin=subprocess.DEVNULL,
                stdout=quiet,
                stderr=quiet,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        finally:
            theirs.close()
        if self.module:
            try:
                self.files = self._warm_up(mine, ready_within)
            except BaseException:
                mine.close()
                _kill_group(proc)
                raise
        self._proc, self._sock, self._pid = proc, mine, os.getpid()
        return mine

    def _warm_up(self, sock: socket.socket, ready_within: float) -> dict[str, list[int] | None]:
        """Hand a new warm server the tool's variables and wait, at most `ready_within` seconds,
        for its word on its module; the files the import read. `NotWarm` when it cannot be forked
        from, or did not answer in time."""
        sock.sendall(b"env " + json.dumps(self.tool_env).encode())
        sock.settimeout(max(0.1, ready_within))
        try:
            said = sock.recv(_MESSAGE_BYTES)
        except TimeoutError:
            raise NotWarm(f"importing it took over {ready_within:g} s, the call's timeout") from None
        finally:
            with contextlib.suppress(OSError):
                sock.settimeout(None)
        try:
            word = json.loads(said)
        except ValueError:
            word = {"warm": False, "why": "its server ended while importing it", "files": {}}
        files = word.get("files") or {}
        if not word.get("warm"):
            raise NotWarm(str(word.get("why") or "it cannot be forked from"), files)
        return files

    def start(self, path: list[str], env: dict[str, str], function: str = "", ready_within: float = 30.0) -> ForkedCall:
        """A new call's process, its request yet to be written to its stdin. `path`: the import
        path the server starts with; `env`: the server's own (allow-listed) environment;
        `function`: the name, in a warm server's module, of the function called; `ready_within`:
        how long a warm server being started may take to import its module."""
        name = function.encode()
        message = b"call " + name if len(name) <= _NAME_BYTES else b"call"
        pipes = [os.pipe() for _ in range(4)]  # stdin, stdout, stderr, status
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][1]]
        try:
            with self._lock:
                self.used = time.monotonic()
                try:
                    socket.send_fds(self._server(path, env, ready_within), [message], theirs)
                except (NotWarm, Retired):
                    raise
                except OSError:  # a server that died: one more try with a fresh one
                    self._sock = None
                    socket.send_fds(self._server(path, env, ready_within), [message], theirs)
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


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """End a server being started (its own process group) and reap it."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


_Key = tuple[str, tuple[str, ...], tuple[tuple[str, str], ...], str]


class _Pool:
    """A worker process's warm servers, and the modules that for a while get none."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.warm: collections.OrderedDict[_Key, ForkServer] = collections.OrderedDict()
        #: modules not to warm: until when, and the files whose change lifts that
        self.cold: dict[_Key, tuple[float, dict[str, list[int] | None]]] = {}

    def server(self, key: _Key, tool_env: dict[str, str]) -> ForkServer | None:
        """The warm server for `key`, made if there is room; None: the plain server's call."""
        retired: list[ForkServer] = []
        try:
            with self.lock:
                now = time.monotonic()
                for k, idle in list(self.warm.items()):
                    if now - idle.used > IDLE_SECONDS:
                        retired.append(self.warm.pop(k))
                cold = self.cold.get(key)
                if cold is not None:
                    until, files = cold
                    if time.monotonic() < until and all(_stamp(p) == st for p, st in files.items()):
                        return None
                    del self.cold[key]
                server = self.warm.get(key)
                if server is not None and server.stale():
                    retired.append(self.warm.pop(key))
                    server = None
                if server is not None:
                    self.warm.move_to_end(key)
                    server.used = now
                    return server
                if len(self.warm) >= max(0, WARM_SERVERS):
                    return None
                server = self.warm[key] = ForkServer(key[0], key[3] or None, tool_env)
                return server
        finally:
            for old in retired:
                old.close()

    def chill(self, key: _Key, server: ForkServer, files: dict[str, list[int] | None]) -> None:
        """`server` could not be forked from: its module goes to the plain server for a while."""
        with self.lock:
            if self.warm.get(key) is server:  # not when already replaced by a newer one
                del self.warm[key]
                self.cold[key] = (time.monotonic() + COLD_SECONDS, files)
        server.close()


_server = ForkServer()
_pool = _Pool()


def _forget_after_fork() -> None:
    """A forked worker process starts servers of its own (its parent's are not its children)."""
    global _server, _pool
    _server, _pool = ForkServer(), _Pool()


os.register_at_fork(after_in_child=_forget_after_fork)


def fork_server() -> ForkServer:
    """This process's plain fork server, which imports no tool module."""
    return _server


def fork_call(spec: str, path: list[str], tool_env: dict[str, str], cwd: str | None, ready_within: float) -> ForkedCall:
    """A process for a call of the python tool `spec` ("module:function"), forked by the warm
    server of its module (imported with import path `path`, in `cwd`, with the tool's variables
    `tool_env`), else by the plain server; its request yet to be written to its stdin. `OSError`
    when no server can start."""
    from celery_agents.tools.command import tool_environment
    from celery_agents.tools.sandbox import python_paths

    module, _, function = spec.partition(":")
    base = tool_environment({}, ())
    key: _Key = (module, tuple(path), tuple(sorted(tool_env.items())), cwd or "")
    for _ in range(3):  # a server retired by another thread meanwhile: its successor's
        server = _pool.server(key, tool_env)
        if server is None:
            break
        try:
            return server.start(path, base, function, ready_within)
        except Retired:
            continue
        except NotWarm as exc:
            log.info("python tool module %s is imported by each call: %s", module[:200], exc.why)
            _pool.chill(key, server, exc.files)
        except OSError as exc:
            log.warning("a fork server for %s cannot start (%s): its calls are forked without it", module[:200], exc)
            _pool.chill(key, server, {})
        break
    return fork_server().start(python_paths(), base)


def warm_servers() -> list[ForkServer]:
    """This process's warm servers, the least recently used first."""
    with _pool.lock:
        return list(_pool.warm.values())


def retire_warm_servers() -> None:
    """Retire every warm server of this process (each leaves once its calls have ended)."""
    with _pool.lock:
        servers = list(_pool.warm.values())
        _pool.warm.clear()
        _pool.cold.clear()
    for server in servers:
        server.close()
