"""Tool tasks: one `runAsync` call on the `tools` queue, one `runIsolated` call on `isolated`.

The call's outcome is recorded once (first writer wins); if it was the last unfinished call of an
auto-driven session, the session is woken.
"""

from __future__ import annotations

from typing import Any

from celery_agents import observe
from celery_agents.runtime import run_call
from celery_agents.tasks.celery_app import app, worker_settings
from celery_agents.tasks.config import CALL_TASK, ISOLATED_TASK, Dispatcher
from celery_agents.tasks.context import execution_owner, worker_context


def _run(task: Any, session_id: str, field: str, isolated: bool) -> str:
    ctx = worker_context(worker_settings())
    owner = execution_owner(task.request)
    tools = ctx.isolated_tools if isolated else ctx.tools
    with observe.call_task(task.request, session_id, field):
        res = run_call(ctx.store, session_id, field, tools, owner, "runIsolated" if isolated else "runAsync")
        if res.child is not None:
            child, version, priority = res.child
            Dispatcher(app).step(child, version, priority=priority)
        if res.finished is not None and res.finished.woken:
            Dispatcher(app).step(session_id, res.finished.version, priority=res.finished.priority)
    return res.status


@app.task(  # type: ignore[untyped-decorator]  # Celery is untyped
    name=CALL_TASK,
    bind=True,
    ignore_result=True,
)
def run_async_call(self: Any, session_id: str, field: str) -> str:
    return _run(self, session_id, field, isolated=False)


@app.task(  # type: ignore[untyped-decorator]  # Celery is untyped
    name=ISOLATED_TASK,
    bind=True,
    ignore_result=True,
)
def run_isolated_call(self: Any, session_id: str, field: str) -> str:
    return _run(self, session_id, field, isolated=True)
