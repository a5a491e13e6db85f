"""Running one dispatched call (runAsync or runIsolated) and recording its outcome once."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from redis.exceptions import LockError

from celery_agents.errors import UntrustedSpec
from celery_agents.model import CallState, TrackedCall
from celery_agents.runtime.lease import LeaseKeeper
from celery_agents.runtime.subagents import run_child_call
from celery_agents.scheduler.ports import ToolPort
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
    k = store.keys
    pipe = store.client.pipeline(transaction=False)
    pipe.hget(k.calls(session_id), field)
    pipe.sismember(k.pending(session_id), field)
    pipe.hmget(k.meta(session_id), ["agent_hash", "status"])
    raw, is_pending, (agent_hash, status) = pipe.execute()
    if raw is None or agent_hash is None:
        return CallRun(status="unknown")
    call = TrackedCall.model_validate_json(raw)
    if not is_pending or status != "active":
        return CallRun(status="already", call=call)
    lease_key = k.call_lease(session_id, field)
    lease = store.lock(lease_key, store.settings.lease_seconds)
    if not store.acquire(lease, owner):
        return CallRun(status="busy", call=call)
    # Picked up: if the lease lapses before an outcome is recorded, this worker died.
    store.client.set(k.call_started(session_id, field), owner, ex=86400)
    try:
        try:
            agent = store.agent(agent_hash)
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
        pending_key = k.pending(session_id)

        def still_wanted() -> bool:
            # A cancelled session empties its pending set: then the call's processes are killed.
            return bool(store.client.sismember(pending_key, field))

        with LeaseKeeper(store, lease_key, owner, still_wanted=still_wanted) as keeper, cancellable(keeper.cancel):
            outcome = tools.run(agent, session_id, call.model_copy(update={"started_at": started}))
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
        finished = store.record_result(
            session_id,
            field,
            body,
            {"call_id": call.call_id, "tool": call.tool, "state": state.value, "duration_ms": outcome.duration_ms},
        )
        return CallRun(status=finished.status, finished=finished, call=call)
    finally:
        with contextlib.suppress(LockError):  # it lapsed, maybe another worker holds it now: not ours
            lease.release()
