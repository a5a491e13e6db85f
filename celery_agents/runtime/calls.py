"""Running one dispatched call (runAsync or runIsolated) and recording its outcome once."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from redis.exceptions import LockError

from celery_agents import observe
from celery_agents.errors import UntrustedSpec
from celery_agents.model import CallState, TrackedCall
from celery_agents.runtime.lease import LeaseKeeper
from celery_agents.runtime.subagents import run_child_call
from celery_agents.scheduler.ports import CallOutcome, ToolPort
from celery_agents.store import Finished, Store, outcome_json
from celery_agents.tools.cancel import cancellable
from celery_agents.tools.output import bound_outcome


@dataclass
class CallRun:
    """What running a dispatched call did: `status` ok, already (final before), busy, unknown, missing;
    for a sub-agent call also started (its child was made now) or running (its child goes on)."""

    status: str
    finished: Finished | None = None
    call: TrackedCall | None = None
    #: a sub-agent call started its child session: publish the child's first step at this version
    child: tuple[str, int] | None = None


def run_call(store: Store, session_id: str, field: str, tools: ToolPort, owner: str) -> CallRun:
    found = store.call_to_run(session_id, field)
    if found is None:
        return CallRun(status="unknown")
    call = found.call
    if not found.pending or found.status != "active":
        return CallRun(status="already", call=call)
    lease = store.call_lock(session_id, field)
    if not store.acquire(lease, owner):
        return CallRun(status="busy", call=call)
    store.mark_call_started(session_id, field, owner)
    try:
        try:
            agent = store.agent(found.agent_hash)
        except UntrustedSpec as exc:
            body = outcome_json(CallState.FAILED, error=f"not run: {exc.message}", now=time.time(), attempts=0)
            event = {"call_id": call.call_id, "tool": call.tool, "state": CallState.FAILED.value}
            finished = store.record_result(session_id, field, body, event)
            return CallRun(status=finished.status, finished=finished, call=call)
        if call.meta.get("child"):
            ran = run_child_call(store, session_id, call, agent)
            status = "started" if ran.started else ran.finished.status if ran.finished else "running"
            return CallRun(status, ran.finished, call, (ran.child, ran.version) if ran.started else None)
        started = time.time()

        def still_wanted() -> bool:
            # A cancelled session empties its pending set: then the call's processes are killed.
            return store.call_pending(session_id, field)

        with observe.tool_call(agent, call) as watch:
            with LeaseKeeper(store, lease.name, owner, still_wanted=still_wanted) as keeper, cancellable(keeper.cancel):
                outcome = tools.run(agent, session_id, call.model_copy(update={"started_at": started}))
            observe.tool_ran(watch, outcome)
        finished = _record(store, session_id, field, call, outcome, started)
        return CallRun(status=finished.status, finished=finished, call=call)
    finally:
        with contextlib.suppress(LockError):  # it lapsed, maybe another worker holds it now: not ours
            lease.release()


def _record(
    store: Store, session_id: str, field: str, call: TrackedCall, outcome: CallOutcome, started: float
) -> Finished:
    """Record the call's outcome (bounded to AGENTS_MAX_RESULT_BYTES); the first writer wins."""
    outcome = bound_outcome(outcome, store.settings.max_result_bytes)
    state, meta = outcome.call_state, outcome.stored_meta()
    body = outcome_json(
        state,
        result=outcome.result,
        error=outcome.error,
        now=time.time(),
        duration_ms=outcome.duration_ms,
        exit_status=outcome.exit_status,
        attempts=outcome.attempts,
        meta=meta or None,
        started_at=started,
    )
    event = {"call_id": call.call_id, "tool": call.tool, "state": state.value, "duration_ms": outcome.duration_ms}
    return store.record_result(session_id, field, body, event)
