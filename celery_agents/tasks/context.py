"""What a worker process needs, built once per process (after the prefork fork)."""

from __future__ import annotations

import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from celery_agents import observe
from celery_agents.config import Settings
from celery_agents.llm import LitellmPort, RetryPolicy
from celery_agents.store import Store, client_for_url, state_url
from celery_agents.tools import ToolRunner


@dataclass
class WorkerContext:
    settings: Settings
    store: Store
    llm: LitellmPort
    tools: ToolRunner
    isolated_tools: ToolRunner


_ctx: WorkerContext | None = None
_pid: int | None = None


#: the first steps of a threads-pool worker start together: one of them builds the context
_build_lock = threading.Lock()


def _reset_after_fork() -> None:
    """A forked pool process starts with its own lock (another thread may have held the parent's)."""
    global _build_lock
    _build_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def worker_context(settings: Settings) -> WorkerContext:
    ctx = _ctx
    if ctx is not None and _pid == os.getpid():
        return ctx
    with _build_lock:
        return _build(settings)


def _build(settings: Settings) -> WorkerContext:
    global _ctx, _pid
    if _ctx is None or _pid != os.getpid():
        observe.setup(settings)
        # A worker waits out a Redis restart instead of dropping the work in flight (store/outage.py).
        store = Store(client_for_url(state_url(settings)), settings, outage_seconds=settings.redis_outage_seconds)
        _ctx = WorkerContext(
            settings=settings,
            store=store,
            llm=LitellmPort(RetryPolicy.from_settings(settings)),
            tools=ToolRunner(tool_env=settings.tool_env),
            isolated_tools=ToolRunner(isolated=True),
        )
        _pid = os.getpid()
    return _ctx


def execution_owner(request: Any) -> str:
    """Who holds a lease for one execution of a task: the host, the process and the task id, plus
    a nonce. A redelivered copy of the same message carries the same task id, and in a threads
    pool it can run in the same process while the first copy still holds the lease: without the
    nonce it would pass for the holder and run the step a second time."""
    return f"{request.hostname or 'worker'}:{os.getpid()}:{request.id}:{uuid.uuid4().hex[:8]}"
