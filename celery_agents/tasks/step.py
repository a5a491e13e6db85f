"""The `step(session_id, expected_version)` task; stale and duplicate copies do nothing."""

from __future__ import annotations

from typing import Any

from celery_agents import observe
from celery_agents.runtime import StepResult, run_step
from celery_agents.runtime.faults import checkpoint
from celery_agents.tasks.celery_app import app, worker_settings
from celery_agents.tasks.config import STEP_TASK, Dispatcher
from celery_agents.tasks.context import execution_owner, worker_context
from celery_agents.tasks.recycle import leave_if_outrun


def publish_after_step(dispatcher: Dispatcher, session_id: str, result: StepResult) -> None:
    """After a commit: dispatched calls to their queues, then the next step if one is owed."""
    if result.outcome != "committed":
        return
    for call in result.dispatch:
        dispatcher.call(session_id, call)
    if result.owed:
        dispatcher.step(session_id, result.version)


@app.task(  # type: ignore[untyped-decorator]  # Celery is untyped
    name=STEP_TASK,
    bind=True,
    ignore_result=True,
)
def step(self: Any, session_id: str, expected_version: int, request: str = "") -> str:
    ctx = worker_context(worker_settings())
    owner = execution_owner(self.request)
    with observe.step(self.request, session_id, int(expected_version)) as watch:
        result = run_step(
            ctx.store,
            session_id,
            int(expected_version),
            llm=ctx.llm,
            tools=ctx.tools,
            owner=owner,
            request=request or "",
        )
        watch.outcome = result.outcome
        if result.outcome == "committed":
            checkpoint("after_commit", ctx.store, session_id)
        publish_after_step(Dispatcher(app), session_id, result)
    leave_if_outrun()
    return result.outcome
