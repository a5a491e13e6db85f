"""`agents worker`: one process that runs the Celery workers a machine needs and watches over them.

A step spends almost all its time waiting on the model, so the `steps` queue is served by Celery
workers with a threads pool: each of `step_processes` processes keeps up to `step_threads` steps
in flight at once, and one process per core lets steps use every core despite the GIL. Tool calls
(`tools`, `isolated`) keep a prefork pool, where each call runs in a pool process that can be
replaced. The supervisor itself calls no model: it holds the worker's services (heartbeat under
the worker's name, sweeper, completions), forwards SIGTERM/SIGINT (warm shutdown: steps in flight
finish) and SIGQUIT (cold) to its Celery workers, and starts again any that exits while it is not
stopping: a steps process leaves by itself when a python tool outran its timeout in one of its
threads (see `tasks/recycle.py`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from celery_agents.config import Settings

log = logging.getLogger("celery_agents.worker")

#: the most steps one steps process keeps in flight by default
DEFAULT_STEP_THREADS = 200
#: steps processes on a machine with many cores, by default (each holds litellm, ~400 MB)
MAX_DEFAULT_STEP_PROCESSES = 8


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
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.backoff = 0.0
        self.due = 0.0

    def start(self, ready_fd: int) -> None:
        me = [sys.executable, "-m", "celery_agents.tasks.supervisor", "--child", self.role, str(os.getpid())]
        self.proc = subprocess.Popen([*me, str(ready_fd), *self.argv], pass_fds=(ready_fd,))
        self.started = time.monotonic()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def check(self, now: float, ready_fd: int) -> None:
        """Start again after an exit; a process that keeps dying young waits longer each time."""
        if self.proc is None:
            if now >= self.due:
                self.start(ready_fd)
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
        from celery_agents.tasks.celery_app import settings
        from celery_agents.tasks.services import WorkerServices, worker_resources
        from celery_agents.tools.sandbox import protect_process

        protect_process()  # as every worker process: tools running as our user cannot read our keys
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
            signal.signal(sig, self._on_signal)
        ready_r, ready_w = os.pipe()
        os.set_blocking(ready_r, False)
        with worker_resources(settings), self._metrics(settings):
            services = WorkerServices(settings, self.plan.name, sorted(self.plan.queues))
            for child in self.children:
                child.start(ready_w)
            log.info("worker %s: %s", self.plan.name, ", ".join(f"{c.role} (pid {c.pid})" for c in self.children))
            ready: set[int] = set()
            try:
                while not self._stop.is_set():
                    # The heartbeat (what `wait_ready`, doctor and the CLI look for) is written once
                    # every Celery worker has said it is ready to take messages.
                    if not services.started and self._ready(ready_r, ready) >= {c.pid for c in self.children}:
                        services.start()
                    now = time.monotonic()
                    for child in self.children:
                        child.check(now, ready_w)
                    select.select([ready_r], [], [], 0.5)
            finally:
                for child in self.children:
                    # Not told yet: stopping for another reason than a signal, or started again
                    # just as the signal came.
                    if not self._stop.is_set() or child.started >= self._stopped_at:
                        child.signal(signal.SIGTERM)
                for child in self.children:
                    if child.proc is not None:
                        child.proc.wait()
                if services.started:
                    services.stop()
                os.close(ready_r)
                os.close(ready_w)
        return 0

    @contextlib.contextmanager
    def _metrics(self, settings: Settings) -> Iterator[None]:
        """`/metrics` while the worker runs: every process of this worker counts into one folder,
        emptied now (the Celery workers inherit its name through the environment)."""
        if self.plan.metrics_port is None:
            yield
            return
        from celery_agents import observe
        from celery_agents.observe.metrics import prepare_dir
        from celery_agents.observe.scrape import serve_worker_metrics

        path = settings.home / "metrics" / self.plan.name.replace("/", "_")
        prepare_dir(path)
        observe.setup(replace(settings, metrics_dir=path))
        server = serve_worker_metrics(self.plan.metrics_host, self.plan.metrics_port, path, settings)
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


def _die_with_parent(parent: int) -> None:
    """A child whose supervisor is SIGKILLed gets SIGTERM (Linux), so none is left behind."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
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

    worker_ready.connect(say_ready, weak=False)

    services.run_as_child(role)
    if role == "steps":
        from celery_agents.llm.adapter import size_http_pool

        threads = int(argv[argv.index("-c") + 1])
        # Every thread may publish at once (the next step, dispatched calls): one broker
        # connection each, instead of queueing for kombu's default 10. And every thread may
        # wait on the model at once.
        app.conf.broker_pool_limit = threads + 4
        size_http_pool(threads + 4)
    app.worker_main(argv)


if __name__ == "__main__":
    if len(sys.argv) > 4 and sys.argv[1] == "--child":
        child_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
