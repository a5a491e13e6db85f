"""Start `agents worker` processes by forking them from one warm process instead of a fresh
interpreter each: a worker costs a fork, not seconds of imports (litellm alone is ~5 s of CPU).

The launcher is one process per test run (started on first use, `python -m tests.support.launcher`)
that imports the third-party modules a worker imports (litellm, Celery, kombu, redis, pydantic...,
found by a probe: `_preload`) and nothing of celery_agents: some of its modules read the
environment when imported, and each worker gets its own. For each request it forks; the child
starts a session of its own, sets its environment, sends stdout and stderr to the log, and runs
`python -m celery_agents.cli`'s code with the worker's argv: the very `agents worker` code,
forking its Celery workers from its own zygote in turn (tasks/supervisor.py).

A process's /proc/<pid>/environ shows the environment it was exec'd with, not the one set after a
fork: a test that looks for a secret there execs its worker (`Worker(..., fork=False)`). A worker
whose environment differs from the launcher's in more than `AGENTS_*`, `FORKABLE` and
`SET_BY_IMPORTS` (a library setting read at import) is exec'd as before (`can_fork`). Protocol on
the launcher's stdin and stdout: a JSON request `{"argv", "env", "log"}` per line; replies `pid N` (in order), and
`exit N CODE` when one ends.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import io
import json
import locale
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MODULE = "celery_agents.cli"
#: keys outside AGENTS_* a forked process may have: read when used, not at import. pytest sets
#: PYTEST_CURRENT_TEST anew for every test: were it compared, only the first test's workers and
#: commands could fork, and every later one would pay a fresh interpreter's imports (~10 s of CPU).
FORKABLE = frozenset({"OPENAI_API_KEY", "COLUMNS", "PYTEST_CURRENT_TEST"})
#: what importing litellm sets in its process's environment (the launcher's imports set them too):
#: a test that called litellm in the test process has them, and its later workers may still fork
SET_BY_IMPORTS = frozenset({"LITELLM_LOG", "TIKTOKEN_CACHE_DIR"})
#: what celery-agents' own import of litellm sets by default (`setdefault`), with that value: a
#: process forked from the launcher sets the same when it first calls a model; any other value is
#: an explicit choice, and rules the fork out
SET_BY_OUR_IMPORT = {"EXPERIMENTAL_OPENAI_BASE_LLM_HTTP_HANDLER": "true"}


def base_env() -> dict[str, str]:
    """The environment of the launcher: the test process's, without `AGENTS_*`, as workers get it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")}
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    env["PYTHONUNBUFFERED"] = "1"
    return env


class LaunchedProcess:
    """A worker forked by the launcher, seen from the test process: what tests use of `Popen`."""

    def __init__(self, launcher: Launcher, pid: int, args: list[str]) -> None:
        self.launcher, self.pid, self.args = launcher, pid, args

    @property
    def returncode(self) -> int | None:
        return self.launcher.exited.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.launcher.changed:
            if not self.launcher.changed.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Launcher:
    """The test process's side: one launcher subprocess, a thread reading its replies."""

    def __init__(self) -> None:
        self.env = base_env()
        # The stdio of an `agents` command goes to the launcher over this socket (SCM_RIGHTS).
        self._fds, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.launcher", str(theirs.fileno())],
            cwd=ROOT,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self.exited: dict[int, int] = {}
        self.changed = threading.Condition()
        self._pids: list[int] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name="launcher-replies", daemon=True).start()

    def can_fork(self, argv: list[str], env: Mapping[str, str]) -> bool:
        """Whether a worker with this argv and environment may be forked (see the module doc)."""
        if argv[1:3] != ["-m", MODULE] or argv[0] != sys.executable:
            return False
        return not self.differences(env) and self.proc.poll() is None

    def differences(self, env: Mapping[str, str]) -> list[str]:
        """The keys of `env` that rule a fork out: those, outside AGENTS_*, FORKABLE and what
        importing litellm sets, whose value differs from the launcher's environment."""

        def fixed(e: Mapping[str, str]) -> dict[str, str]:
            return {k: v for k, v in e.items() if not k.startswith("AGENTS_") and k not in FORKABLE | SET_BY_IMPORTS}

        ours, theirs = fixed(self.env), fixed(env)
        for key, value in SET_BY_OUR_IMPORT.items():
            if ours.get(key, value) == value and theirs.get(key, value) == value:
                ours.pop(key, None)
                theirs.pop(key, None)
        return sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))

    def spawn(
        self,
        argv: list[str],
        env: Mapping[str, str],
        log: Path | None = None,
        stdio: tuple[int, int, int] | None = None,
        cwd: Path | None = None,
    ) -> LaunchedProcess:
        """Fork `argv`: a worker in a session of its own writing to `log`, or (`stdio`) a command
        in the test run's process group with these stdin, stdout and stderr."""
        request = {"argv": argv, "env": dict(env), "log": str(log) if log else None, "cwd": str(cwd or "")}
        request["stdio"] = stdio is not None
        with self._lock, self.changed:
            assert self.proc.stdin is not None
            if stdio is not None:
                socket.send_fds(self._fds, [b"."], list(stdio))
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            if not self.changed.wait_for(lambda: self._pids or self.proc.poll() is not None, 300):
                raise RuntimeError("the launcher did not answer within 300 s (its first answer waits for its imports)")
            if not self._pids:
                raise RuntimeError(f"the launcher exited with {self.proc.returncode}")
            return LaunchedProcess(self, self._pids.pop(0), argv)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            word, *numbers = line.decode().split()
            with self.changed:
                if word == "pid":
                    self._pids.append(int(numbers[0]))
                else:
                    self.exited[int(numbers[0])] = int(numbers[1])
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run(
    argv: list[str], env: Mapping[str, str], stdin: str | None, timeout: float, cwd: Path | None = None
) -> tuple[int, str, str]:
    """`subprocess.run(argv, env, input=stdin, capture_output=True, text=True, timeout, cwd)` for a
    command the launcher may fork (`launcher().can_fork`): returncode, stdout, stderr."""
    pipes = [os.pipe() for _ in range(3)]
    # In our working directory when no other is given, as a child of ours would be.
    proc = launcher().spawn(argv, env, stdio=(pipes[0][0], pipes[1][1], pipes[2][1]), cwd=cwd or Path.cwd())
    for fd in (pipes[0][0], pipes[1][1], pipes[2][1]):
        os.close(fd)
    out: dict[int, bytes] = {}

    def feed() -> None:
        with contextlib.suppress(BrokenPipeError), os.fdopen(pipes[0][1], "wb") as w:
            w.write((stdin or "").encode())

    def drain(i: int) -> None:
        with os.fdopen(pipes[i][0], "rb") as r:
            out[i] = r.read()

    threads = [threading.Thread(target=feed, daemon=True)]
    threads += [threading.Thread(target=drain, args=(i,), daemon=True) for i in (1, 2)]
    for t in threads:
        t.start()
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    for t in threads:
        t.join(timeout)

    def text(data: bytes) -> str:  # as `text=True` reads it: the locale's encoding, newlines translated
        return io.TextIOWrapper(io.BytesIO(data), encoding=locale.getpreferredencoding(False)).read()

    return code, text(out.get(1, b"")), text(out.get(2, b""))


_launcher: Launcher | None = None
_launcher_lock = threading.Lock()


def launcher() -> Launcher:
    """The test run's launcher, started on first use and stopped when the run ends."""
    global _launcher
    with _launcher_lock:
        if _launcher is None or _launcher.proc.poll() is not None:
            _launcher = Launcher()
            atexit.register(_launcher.close)
        return _launcher


# ---- the launcher process ------------------------------------------------------------------------


def _preload() -> None:
    """What an `agents worker` imports from other projects, imported here once: a probe child (then
    thrown away) starts a worker's imports and warms litellm up as a steps process does, and lists
    the modules that are not celery_agents' (those read AGENTS_* when imported: each worker
    imports them afresh, in a fraction of a second)."""
    os.environ.setdefault("LITELLM_LOG", "ERROR")  # as celery_agents.llm.adapter.ensure_litellm
    for name in _probe():
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    gc.collect()
    gc.freeze()  # a worker's collections leave these pages shared (as in tasks/supervisor.py)


def _probe() -> list[str]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            import celery.apps.worker
            import celery.concurrency.prefork
            import celery.concurrency.thread

            import celery_agents.cli.main
            import celery_agents.tasks.celery_app
            import celery_agents.tasks.supervisor
            from celery_agents.llm.adapter import warm_up
            from celery_agents.model import build_schemas

            del celery, celery_agents
            warm_up()
            build_schemas()
            names = [m for m in sys.modules if m.split(".")[0] not in ("celery_agents", "tests", "__main__")]
            with os.fdopen(write, "w") as out:
                json.dump(names, out)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as found:
        text = found.read()
    os.waitpid(pid, 0)
    return list(json.loads(text)) if text else []


def _serve(fds: socket.socket) -> None:
    _preload()
    requests, replies = sys.stdin.fileno(), sys.stdout.fileno()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    buf = b""
    while True:
        readable, _, _ = select.select([requests, wake_r], [], [], 1.0)
        if wake_r in readable:
            os.read(wake_r, 4096)
        _reap(children, replies)
        if requests not in readable:
            continue
        data = os.read(requests, 1 << 20)
        if not data:  # the test run is over; its workers were stopped or are its to stop
            return
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            request = json.loads(line)
            stdio = socket.recv_fds(fds, 1, 3)[1] if request["stdio"] else []
            pid = os.fork()
            if pid == 0:
                _child(request, stdio, (requests, replies, wake_r, wake_w, fds.fileno()))
            for fd in stdio:
                os.close(fd)
            children.add(pid)
            os.write(replies, f"pid {pid}\n".encode())


def _reap(children: set[int], replies: int) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        os.write(replies, f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


def _child(request: dict[str, Any], stdio: list[int], launcher_fds: tuple[int, ...]) -> None:
    """In the forked child: become the process `Popen(argv, env, ...)` makes. A worker (no
    `stdio`) starts a session of its own and writes to its log; a command gets the caller's pipes."""
    code: int | str | None = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if stdio:
            std = stdio
        else:
            os.setsid()
            out = os.open(request["log"] or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            std = [os.open(os.devnull, os.O_RDONLY), out, out]
        for target, fd in enumerate(std):
            os.dup2(fd, target)
        for fd in {*std, *launcher_fds}:
            if fd > 2:
                os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        if request["cwd"]:
            os.chdir(request["cwd"])
        sys.argv = [MODULE, *request["argv"][3:]]
        runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        _exit(code)


def _exit(code: int | str | None) -> None:
    """Leave as an interpreter does (non-daemon threads joined, atexit, streams flushed)."""
    with contextlib.suppress(Exception):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))
