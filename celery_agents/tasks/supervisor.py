"""`agents worker`: one process that runs the Celery workers a machine needs and watches over them.

A step spends almost all its time waiting on the model, so the `steps` queue is served by Celery
workers with a threads pool: each of `step_processes` processes keeps up to `step_threads` steps
in flight at once, and one process per core lets steps use every core despite the GIL. Tool calls
(`tools`, `isolated`) keep a prefork pool, where each call runs in a pool process that can be
replaced. The supervisor itself calls no model: it holds the worker's services (heartbeat under
the worker's name, sweeper, completions), forwards SIGTERM/SIGINT (warm shutdown: steps in flight
finish) and SIGQUIT (cold) to its Celery workers, and starts again any that exits while it is not
stopping.

The Celery workers are forked, not started afresh: the supervisor forks a zygote before it starts
any thread, the zygote imports what a Celery worker needs (Celery's worker, the app, litellm when
there are steps) once, and forks every Celery worker from there, at start and when one is started
again. A machine pays litellm's import (seconds of CPU) once per `agents worker`, not once per
Celery worker, and the workers share those pages. The tools worker, which calls no model, is forked
from a zygote of its own that never imports litellm: its main process and each of its pool
processes map ~130 MB less. A zygote never starts a thread (a fork from a threaded process may
inherit a lock held for ever), reaps its children and reports their exits.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from celery_agents.config import Settings

log = logging.getLogger("celery_agents.worker")

#: the most steps one steps process keeps in flight by default
DEFAULT_STEP_THREADS = 200
#: steps processes on a machine with many cores, by default (each holds litellm, ~400 MB)
MAX_DEFAULT_STEP_PROCESSES = 8
#: how long (s) a thread of a steps process runs Python before the interpreter makes it hand the
#: GIL to another that asks (Python's default: 0.005). Hundreds of threads each run a step's
#: Python between two waits (Redis, the model) and give the GIL up there anyway; forcing a
#: switch every 5 ms on top of that only adds hand-overs: the slow-model phase (300 sessions,
#: 3 steps each) took ~11.3 instead of ~14.1 ms of CPU per step in the steps processes at 0.05.
STEP_SWITCH_INTERVAL = 0.05


def default_step_processes() -> int:
    """One steps process per usable core (the GIL lets one process use one core), at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_DEFAULT_STEP_PROCESSES))


@dataclass(frozen=True)
class WorkerPlan:
    """Which Celery workers one `agents worker` runs."""

    queues: list[str]
    name: str
    #: prefork processes for the `tools` and `isolated` queues
    tool_processes: int = 2
    step_processes: int = field(default_factory=default_step_processes)
    step_threads: int = DEFAULT_STEP_THREADS
    loglevel: str = "INFO"
    #: serve Prometheus metrics on 127.0.0.1:metrics_port (None: keep no metrics)
    metrics_port: int | None = None
    #: the address `/metrics` listens on: loopback unless a container's scraper must reach it
    metrics_host: str = "127.0.0.1"

    @property
    def node(self) -> tuple[str, str]:
        node, _, host = self.name.partition("@")
        return node, host or "%h"

    def children(self) -> list[tuple[str, list[str]]]:
        """(role, `celery worker` argv) of each Celery worker to run."""
        from celery_agents.tasks.config import worker_argv

        node, host = self.node
        out: list[tuple[str, list[str]]] = []
        if "steps" in self.queues:
            for i in range(self.step_processes):
                argv = worker_argv(["steps"], self.step_threads, self.loglevel, f"{node}-steps{i}@{host}", "threads")
                out.append(("steps", argv))
        tool_queues = [q for q in self.queues if q != "steps"]
        if tool_queues:
            out.append(("tools", worker_argv(tool_queues, self.tool_processes, self.loglevel, f"{node}-tools@{host}")))
        return out


class _Child:
    """One supervised Celery worker process, started again when it exits on its own."""

    def __init__(self, role: str, argv: list[str]) -> None:
        self.role, self.argv = role, argv
        self.proc: Forked | None = None
        self.started = 0.0
        self.backoff = 0.0
        self.due = 0.0

    def start(self, zygote: Zygote, ready_fd: int) -> None:
        self.proc = zygote.spawn(self.role, ready_fd, self.argv)
        self.started = time.monotonic()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def check(self, now: float, zygote: Zygote, ready_fd: int) -> None:
        """Start again after an exit; a process that keeps dying young waits longer each time."""
        if self.proc is None:
            if now >= self.due:
                self.start(zygote, ready_fd)
            return
        code = self.proc.poll()
        if code is None:
            return
        lived = now - self.started
        self.backoff = 0.0 if lived > 60 else min(30.0, max(1.0, self.backoff * 2))
        log.warning(
            "%s worker (pid %s) exited with %s after %.1f s; starting another", self.role, self.proc.pid, code, lived
        )
        self.proc = None
        self.due = now + self.backoff


class Supervisor:
    def __init__(self, plan: WorkerPlan) -> None:
        self.plan = plan
        self.children = [_Child(role, argv) for role, argv in plan.children()]
        self._stop = threading.Event()
        self._stopped_at = float("inf")

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Forwarded to every Celery worker as is: SIGTERM and a first Ctrl-C are a warm shutdown,
        SIGQUIT and a second Ctrl-C (Celery counts them) a cold one."""
        self._stopped_at = time.monotonic()
        self._stop.set()
        for child in self.children:
            child.signal(signum)

    def run(self) -> int:
        from celery_agents.config import Settings
        from celery_agents.store.connection import broker_url
        from celery_agents.tasks.celery_app import worker_settings
        from celery_agents.tasks.services import WorkerServices, worker_resources
        from celery_agents.tools.sandbox import protect_process

        # Where the queues live, before any process starts: state on a Redis Cluster without
        # AGENTS_BROKER_URL is refused here (BrokerMissing, exit 2), not by every child in a loop.
        broker_url(Settings.from_env())
        protect_process()  # as every worker process: tools running as our user cannot read our keys
        ready_r, ready_w = os.pipe()
        os.set_blocking(ready_r, False)
        # Before the zygote: the Celery workers it forks inherit the metrics folder's name.
        metrics_path = self._metrics_folder(Settings.from_env().home)
        if "steps" in self.plan.queues:
            from celery_agents.llm.loop import allow_connections

            # Every thread of a steps process may wait on the model at once. Before the zygote
            # imports litellm, which reads its connection limits then.
            allow_connections(self.plan.step_threads + 4)
        # Before any thread and any signal handler of ours: the zygotes' children inherit neither.
        # One zygote per role: the tools worker's holds no litellm.
        zygotes: dict[str, Zygote] = {}
        for role in dict.fromkeys(c.role for c in self.children):
            inherited = [fd for z in zygotes.values() for fd in (z.requests, z.replies)]
            zygotes[role] = Zygote.start(steps=role == "steps", close=inherited)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
            signal.signal(sig, self._on_signal)
        code = 0
        settings = worker_settings()
        with contextlib.ExitStack() as stack:
            for zygote in zygotes.values():
                stack.callback(zygote.stop)  # also when the state Redis refuses us here
            stack.enter_context(worker_resources(settings))
            stack.enter_context(self._metrics(settings, metrics_path))
            services = WorkerServices(settings, self.plan.name, sorted(self.plan.queues))
            for child in self.children:
                child.start(zygotes[child.role], ready_w)
            log.info("worker %s: %s", self.plan.name, ", ".join(f"{c.role} (pid {c.pid})" for c in self.children))
            ready: set[int] = set()
            try:
                while not self._stop.is_set():
                    # The heartbeat (what `wait_ready`, doctor and the CLI look for) is written once
                    # every Celery worker has said it is ready to take messages.
                    if not services.started and self._ready(ready_r, ready) >= {c.pid for c in self.children}:
                        services.start()
                    gone = [z for z in zygotes.values() if not z.pump()]
                    if gone:
                        log.critical("the zygote (pid %s) is gone: no Celery worker can be started again", gone[0].pid)
                        code = 1
                        break
                    now = time.monotonic()
                    for child in self.children:
                        child.check(now, zygotes[child.role], ready_w)
                    select.select([ready_r, *(z.replies for z in zygotes.values())], [], [], 0.5)
            finally:
                for child in self.children:
                    # Not told yet: stopping for another reason than a signal, or started again
                    # just as the signal came.
                    if not self._stop.is_set() or child.started >= self._stopped_at:
                        child.signal(signal.SIGTERM)
                for child in self.children:
                    if child.proc is not None:
                        child.proc.wait()
                for zygote in zygotes.values():
                    zygote.stop()
                if services.started:
                    services.stop()
                os.close(ready_r)
                os.close(ready_w)
        return code

    def _metrics_folder(self, home: Path) -> Path | None:
        """The folder every process of this worker counts metrics into, emptied now and named in
        the environment its Celery workers inherit; None without `--metrics-port`."""
        if self.plan.metrics_port is None:
            return None
        from celery_agents.observe.metrics import prepare_dir, worker_folder

        path = worker_folder(home / "metrics", self.plan.name)
        prepare_dir(path)
        return path

    @contextlib.contextmanager
    def _metrics(self, settings: Settings, path: Path | None) -> Iterator[None]:
        """`/metrics` while the worker runs (the supervisor counts too: completions, sweeps)."""
        if self.plan.metrics_port is None or path is None:
            yield
            return
        from celery_agents import observe
        from celery_agents.errors import InvalidInput
        from celery_agents.observe.scrape import serve_worker_metrics

        observe.setup(settings.replace(metrics_dir=path))
        host, port = self.plan.metrics_host, self.plan.metrics_port
        try:
            server = serve_worker_metrics(host, port, path, settings)
        except OSError as exc:  # the port taken, or not ours to take: refuse to start, saying so
            why = exc.strerror or str(exc)
            raise InvalidInput(f"--metrics-port {port}: cannot listen on {host}:{port}: {why}") from None
        log.info("metrics on http://%s:%s/metrics", self.plan.metrics_host, server.port)
        try:
            yield
        finally:
            server.close()

    @staticmethod
    def _ready(fd: int, ready: set[int]) -> set[int]:
        """The pids of the Celery workers that said they are ready, so far."""
        with contextlib.suppress(BlockingIOError, InterruptedError):
            for line in os.read(fd, 65536).decode().split():
                ready.add(int(line))
        return ready


class Forked:
    """A Celery worker forked by the zygote, seen from the supervisor (the subset of `Popen` used)."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid

    @property
    def returncode(self) -> int | None:
        return self.zygote.exited.get(self.pid)

    def poll(self) -> int | None:
        self.zygote.pump()
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None and self.zygote.alive:
            select.select([self.zygote.replies], [], [], 1.0)
        # A zygote gone takes its children with it (their parent-death signal).
        return self.returncode if self.returncode is not None else -signal.SIGKILL

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


class Zygote:
    """The process every Celery worker of one `agents worker` is forked from (see the module doc).

    Requests go down a pipe (one JSON line: role, ready fd, argv); replies come up another:
    `pid N` for each request, in order, and `exit N CODE` when a child ends (CODE as `Popen`'s
    returncode: negative for a signal)."""

    def __init__(self, pid: int, requests: int, replies: int) -> None:
        self.pid, self.requests, self.replies = pid, requests, replies
        self.exited: dict[int, int] = {}
        self.alive = True
        self._pids: list[int] = []
        self._buf = b""

    @classmethod
    def start(cls, steps: bool, close: list[int] | None = None) -> Zygote:
        """Fork a zygote; `close`: the supervisor's ends of other zygotes' pipes, which this one
        must not hold open (a zygote leaves when its request pipe has no writer left)."""
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the zygote, which never returns
            code = 1
            try:
                for fd in (req_w, rep_r, *(close or [])):
                    os.close(fd)
                _zygote_main(parent, req_r, rep_w, steps)
                code = 0
            finally:
                os._exit(code)
        os.close(req_r)
        os.close(rep_w)
        os.set_blocking(rep_r, False)
        return cls(pid, req_w, rep_r)

    def spawn(self, role: str, ready_fd: int, argv: list[str]) -> Forked:
        os.write(self.requests, (json.dumps([role, ready_fd, argv]) + "\n").encode())
        while not self._pids:
            if not self.alive:
                raise RuntimeError("the zygote is gone")
            select.select([self.replies], [], [], 1.0)
            self.pump()
        return Forked(self, self._pids.pop(0))

    def pump(self) -> bool:
        """Read what the zygote said so far; False once it is gone."""
        while self.alive:
            try:
                data = os.read(self.replies, 65536)
            except (BlockingIOError, InterruptedError):
                break
            if not data:
                self.alive = False
                break
            self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            word, *numbers = line.decode().split()
            if word == "pid":
                self._pids.append(int(numbers[0]))
            elif word == "exit":
                self.exited[int(numbers[0])] = int(numbers[1])
        return self.alive

    def stop(self) -> None:
        """No more requests: the zygote waits for its children, then leaves."""
        if self.requests < 0:
            return
        os.close(self.requests)
        self.requests = -1
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        os.close(self.replies)


def _zygote_main(parent: int, requests: int, replies: int, steps: bool) -> None:
    """The zygote: preload, then fork a Celery worker per request until the supervisor closes the
    pipe (or dies: then this process is killed, and its children hear of it in turn)."""
    _die_with_parent(parent, signal.SIGKILL)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)  # the supervisor decides what its Celery workers hear
    logging.root.handlers.clear()  # a Celery worker sets up its own logging, not the supervisor's
    _preload(steps)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    buf = b""
    open_ = True
    while open_ or children:
        readable, _, _ = select.select([requests, wake_r] if open_ else [wake_r], [], [], 1.0)
        if wake_r in readable:
            os.read(wake_r, 4096)
        _reap(children, replies)
        if requests not in readable:
            continue
        data = os.read(requests, 65536)
        open_ = bool(data)
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            role, ready_fd, argv = json.loads(line)
            pid = os.fork()
            if pid == 0:  # pragma: no cover - a Celery worker, which never returns
                _forked_child(role, ready_fd, argv, (requests, replies, wake_r, wake_w))
            children.add(pid)
            os.write(replies, f"pid {pid}\n".encode())


def _preload(steps: bool) -> None:
    """What every Celery worker imports, imported once (no thread may start here)."""
    import celery.apps.worker
    import celery.concurrency.prefork
    import celery.concurrency.thread  # noqa: F401

    import celery_agents.tasks.celery_app  # noqa: F401

    if steps:
        from celery_agents.llm.adapter import ensure_litellm

        ensure_litellm()
    # Out of the collector's sight: a child's collections then leave these pages shared instead of
    # touching (copying) every object the zygote holds.
    gc.collect()
    gc.freeze()


def _reap(children: set[int], replies: int) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.discard(pid)
        os.write(replies, f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


def _forked_child(role: str, ready_fd: int, argv: list[str], zygote_fds: tuple[int, ...]) -> None:
    """A Celery worker just forked from the zygote: undo what is the zygote's, run, never return."""
    code: int | str | None = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        for fd in zygote_fds:
            os.close(fd)
        child_main(role, os.getppid(), ready_fd, argv)
        code = 0
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        log.exception("%s worker failed", role)
    finally:
        _exit_as_python_does(code)


def _exit_as_python_does(code: int | str | None) -> None:
    """What an interpreter does on its way out (join non-daemon threads, atexit, flush), then exit
    without unwinding into the zygote's frames."""
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


def _die_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """A process whose parent is SIGKILLed gets `sig` (Linux), so none is left behind."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, sig)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        raise SystemExit(0)


def child_main(role: str, parent: int, ready_fd: int, argv: list[str]) -> None:
    """One supervised Celery worker: no services of its own (the supervisor has them); says on
    `ready_fd` when it takes messages."""
    _die_with_parent(parent)
    from celery.signals import worker_ready

    from celery_agents.tasks import services
    from celery_agents.tasks.celery_app import app

    def say_ready(**_: object) -> None:
        os.write(ready_fd, f"{os.getpid()}\n".encode())
        if role == "steps":
            log.info("steps process %s: GIL switch interval %g s", os.getpid(), sys.getswitchinterval())

    worker_ready.connect(say_ready, weak=False)

    services.run_as_child(role)
    if role == "steps":
        threads = int(argv[argv.index("-c") + 1])
        # Every thread may publish at once (the next step, dispatched calls): one broker
        # connection each, instead of queueing for kombu's default 10.
        app.conf.broker_pool_limit = threads + 4
        sys.setswitchinterval(STEP_SWITCH_INTERVAL)
    app.worker_main(argv)
