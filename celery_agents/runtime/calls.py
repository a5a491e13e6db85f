"""Running one dispatched call (runAsync or runIsolated) and recording its outcome once.

The call runs under its lease. A worker frozen past it (the sweeper handed the call to another,
which took the lease) is stopped when it wakes, at its next renewal, and its outcome is refused
while the other holds the lease: the run that counts is the holder's, never one the holder's
recording would race.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from celery_agents import observe
from celery_agents.errors import UntrustedSpec
from celery_agents.model import CallMeta, CallOutcome, CallState, Lane, TrackedCall
from celery_agents.runtime.lease import LeaseKeeper
from celery_agents.runtime.subagents import run_child_call
from celery_agents.scheduler.machine import granted
from celery_agents.scheduler.policy import dispatched_refusal
from celery_agents.scheduler.ports import ToolPort
from celery_agents.store import Finished, Store, outcome_json
from celery_agents.store.counters import Counts
from celery_agents.tools.cancel import cancellable
from celery_agents.tools.output import bound_outcome

log = logging.getLogger(__name__)


@dataclass
class CallRun:
    """What running a dispatched call did: `status` ok, already (final before), busy, unknown, missing,
    refused (its stored record disagrees with the signed spec: failed, nothing run);
    for a sub-agent call also started (its child was made now) or running (its child goes on)."""

    status: str
    finished: Finished | None = None
    call: TrackedCall | None = None
    #: a sub-agent call started its child session: publish the child's first step (session,
    #: version, priority)
    child: tuple[str, int, int] | None = None


def run_call(store: Store, session_id: str, field: str, tools: ToolPort, owner: str, lane: Lane) -> CallRun:
    """Run the dispatched call at `field` in `lane` (`tools` is that lane's port), if the verified
    spec's policy runs it there, and record its outcome once."""
    found = store.call_to_run(session_id, field)
    if found is None:
        return CallRun(status="unknown")
    call = found.call
    if not found.pending or not found.runnable:
        return CallRun(status="already", call=call)
    lease = store.call_lock(session_id, field)
    if not store.acquire(lease, owner):
        return CallRun(status="busy", call=call)
    try:
        # Looked at before the lease: another delivery of this call (a republish, a redelivery)
        # may have run and recorded it meanwhile, and let its lease go. Once the lease is ours, a
        # call still unfinished stays so until we record it.
        if not store.through_outage(lambda: store.call_pending(session_id, field)):
            return CallRun(status="already", call=call)
        store.mark_call_started(session_id, field, owner)
        try:
            agent = store.agent(found.agent_hash, session_id)
        except UntrustedSpec as exc:
            body = outcome_json(CallState.FAILED, error=f"not run: {exc.message}", now=time.time(), attempts=0)
            event = {"call_id": call.call_id, "tool": call.tool, "state": CallState.FAILED.value}
            finished = store.record_result(session_id, field, body, event, owner=owner)
            return CallRun(status=finished.status, finished=finished, call=call)
        why = dispatched_refusal(
            agent,
            session_id,
            call,
            lane,
            granted=granted(found.grants, agent, call.tool),
            decided=found.decision is not None,
        )
        if why is not None:
            return _refuse(store, session_id, field, call, lane, why, owner)
        decided: dict[str, Any] = {}
        if found.decision is not None and found.decision.arguments is not None:
            # What the person approved runs (as their decision recorded it), and the transcript says so.
            call = call.model_copy(update={"arguments": found.decision.arguments})
            decided = {"arguments": call.arguments, "decision": found.decision.outcome, "decided_by": found.decision.by}
        if agent.sub_agent(call.tool) is not None:
            ran = run_child_call(store, session_id, call, agent)
            status = "started" if ran.started else ran.finished.status if ran.finished else "running"
            return CallRun(status, ran.finished, call, (ran.child, ran.version, ran.priority) if ran.started else None)
        started = time.time()

        def still_wanted() -> bool:
            # A cancelled session empties its pending calls: then the call's processes are killed.
            return store.call_pending(session_id, field)

        with observe.tallying() as tally, observe.tool_call(agent, call) as watch:
            with LeaseKeeper(store, lease.name, owner, still_wanted=still_wanted) as keeper, cancellable(keeper.cancel):
                outcome = tools.run(agent, session_id, call.model_copy(update={"started_at": started}))
            observe.tool_ran(watch, outcome)
        if keeper.lost:
            # Another worker took the call's lease: its run is the one that counts (if it dies, the
            # call is handed on again); what this stopped run returns is not recorded.
            log.warning("call %s of session %s: its lease was taken over: outcome not recorded", field, session_id)
            return CallRun(status="lost", call=call)
        finished = _record(store, session_id, field, call, outcome, started, owner, decided, counts=tally.counts)
        return CallRun(status=finished.status, finished=finished, call=call)
    finally:
        store.let_go(lease)


def _refuse(store: Store, session_id: str, field: str, call: TrackedCall, lane: Lane, why: str, owner: str) -> CallRun:
    """A stored call the signed spec does not allow here: nothing runs; the model is told, the
    session's events say `call_refused`, the worker's log and metrics count it."""
    log.warning("refused to run call %s of session %s in %s: %s", field, session_id, lane, why)
    counts = observe.call_refused(lane)
    body = outcome_json(
        CallState.FAILED,
        error=f"not run: {why} (a stored call that disagrees with the signed agent spec is refused)",
        now=time.time(),
        attempts=0,
    )
    event = {"call_id": call.call_id, "tool": call.tool[:64], "state": CallState.FAILED.value, "lane": lane, "why": why}
    finished = store.record_result(session_id, field, body, event, refused=True, counts=counts, owner=owner)
    return CallRun(status="refused" if finished.status == "ok" else finished.status, finished=finished, call=call)


def _record(
    store: Store,
    session_id: str,
    field: str,
    call: TrackedCall,
    outcome: CallOutcome,
    started: float,
    owner: str,
    decided: dict[str, Any] | None = None,
    counts: Counts | None = None,
) -> Finished:
    """Record the call's outcome (bounded to AGENTS_MAX_RESULT_BYTES); the first writer wins, while
    `owner` still holds the call's lease or nobody does (another holder's run is the one that counts).
    `decided`: an approved gate's arguments (what ran) and decision, kept with its outcome;
    `counts`: what running it counted, for the fleet's counters."""
    outcome = bound_outcome(outcome, store.settings.max_result_bytes)
    state, meta = outcome.call_state, outcome.stored_meta()
    if decided:
        meta |= CallMeta(decision=decided["decision"], decided_by=decided["decided_by"])
    body = outcome_json(
        state,
        result=outcome.result,
        error=outcome.error,
        now=time.time(),
        duration_ms=outcome.duration_ms,
        exit_status=outcome.exit_status,
        attempts=outcome.attempts,
        meta=meta,
        started_at=started,
    )
    if decided:
        body = json.dumps({**json.loads(body), "arguments": decided["arguments"]}, ensure_ascii=False)
    event = {"call_id": call.call_id, "tool": call.tool, "state": state.value, "duration_ms": outcome.duration_ms}
    return store.record_result(session_id, field, body, event, counts=counts, owner=owner)
