"""The `step(session_id, expected_version)` task; stale and duplicate copies do nothing.

On a Redis broker its queue is consumed without acknowledgement (`tasks/config.py`
`steps_unacknowledged`): the message left Redis when the worker took it, and what brings back a
step whose worker died is the outbox and the sweeper, not the broker. Celery still acknowledges
such a message through the broker (kombu's virtual transport keeps no list of no-ack consumers,
so `message.ack()` runs kombu's unacked bookkeeping for a message it never tracked);
`StepRequest` marks it acknowledged instead.
"""

from __future__ import annotations

from typing import Any

from celery.worker.request import Request

from celery_agents import observe
from celery_agents.model import State
from celery_agents.runtime import StepResult, run_step
from celery_agents.runtime.faults import checkpoint
from celery_agents.runtime.subagents import settle_parent
from celery_agents.store import Store
from celery_agents.tasks.celery_app import app, worker_settings
from celery_agents.tasks.config import STEP_TASK, Dispatcher
from celery_agents.tasks.context import execution_owner, worker_context

#: the request of a step a released slot woke (a fleet concurrency limit), and of its one retry
WOKEN, WOKEN_AGAIN = "woken", "woken-again"


def publish_after_step(
    dispatcher: Dispatcher, store: Store, session_id: str, result: StepResult, request: str = ""
) -> None:
    """After a commit: dispatched calls to their queues, then the next step if one is owed; a child
    session that ended records its outcome into its parent's call, which may wake the parent. A
    step a fleet limit put back is published again for the time its model call may start (a step
    waiting for a slot is not: a released slot wakes it); the steps a released slot woke are
    published now."""
    if result.outcome == "committed":
        for call in result.dispatch:
            dispatcher.call(session_id, call)
        if result.owed:
            dispatcher.step(session_id, result.version, priority=result.priority)
    throttled = result.throttled
    if throttled is not None and throttled.requeue:
        # Counted from Redis's clock on both ends (the admission's now and until); the countdown
        # itself runs on the clock of the worker that takes the message.
        dispatcher.step(session_id, result.version, request, priority=result.priority, countdown=throttled.countdown)
    for woken in result.woken:
        dispatcher.step(woken.session_id, woken.version, WOKEN, priority=woken.priority)
    if result.parent is not None and result.state in (State.COMPLETED, State.FAILED):
        checkpoint("child_finished", store, session_id)
        finished = settle_parent(store, store.header(session_id))
        if finished is not None and finished.woken:
            dispatcher.step(result.parent, finished.version, priority=finished.priority)


class StepRequest(Request):  # type: ignore[misc]  # Celery is untyped
    """A step's request: a message taken from a queue consumed without acknowledgement is
    acknowledged or rejected without a word to the broker (nothing there holds it); from any other
    queue, as Celery does."""

    def acknowledge(self) -> None:
        if self._broker_holds_nothing():
            self.acknowledged = True
        else:
            super().acknowledge()

    def reject(self, requeue: bool = False) -> None:
        if not self._broker_holds_nothing():
            super().reject(requeue=requeue)
        elif not self.acknowledged:
            # Nothing to requeue: the step is owed, and the sweeper publishes it again.
            self.acknowledged = True
            self.send_event("task-rejected", requeue=False)

    def _broker_holds_nothing(self) -> bool:
        queue = self._app.amqp.queues.get(self.delivery_info.get("routing_key"))
        return bool(queue is not None and queue.no_ack)


@app.task(  # type: ignore[untyped-decorator]  # Celery is untyped
    name=STEP_TASK,
    bind=True,
    ignore_result=True,
    Request=StepRequest,
)
def step(self: Any, session_id: str, expected_version: int, request: str = "") -> str:
    ctx = worker_context(worker_settings())
    owner = execution_owner(self.request)
    # The message has left the queue and `begin_step` has not marked the step picked up.
    checkpoint("step_taken", ctx.store, session_id)
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
            if result.parent is not None:
                checkpoint("child_committed", ctx.store, session_id)
        publish_after_step(Dispatcher(app), ctx.store, session_id, result, request or "")
        if result.outcome == "busy" and request == WOKEN:
            # Woken by a released slot while the step that queued it was still letting its lease
            # go: it looks once more shortly after (the sweeper would, much later).
            Dispatcher(app).step(session_id, int(expected_version), WOKEN_AGAIN, countdown=0.2)
    return result.outcome
