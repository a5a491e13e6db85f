"""Sub-agent calls: the child session a `prompt_agent_<slug>` call starts, and the call's outcome
once that child ends.

A call's child has an id derived from the call (`child_session_id`), so starting it again after
a crash or a redelivery finds the same session instead of making a second. The parent's call
stays dispatched until the child's end is recorded into it: the worker that commits the child's
last step records it at once (`settle_parent`); if that worker dies first, the sweeper publishes
the call again (after AGENTS_LOST_GRACE) and its next run finds the child ended and records it
(`run_child_call`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from celery_agents.model import AgentSpec, CallMeta, CallState, SessionHeader, Status, TrackedCall, UserQuery
from celery_agents.runtime.faults import checkpoint
from celery_agents.store import Finished, Store, outcome_json


@dataclass
class ChildRun:
    """What a run of a sub-agent call did: started its child (publish the child's first step at
    `version`), found it still running, or recorded its end into the call (`finished`)."""

    child: str
    started: bool = False
    version: int = 0
    finished: Finished | None = None
    #: the child's priority (its first step is published with it)
    priority: int = 5


def run_child_call(store: Store, session_id: str, call: TrackedCall, agent: AgentSpec) -> ChildRun:
    """Start the call's child session if it does not exist yet; else record its end if it ended."""
    child = call.meta.child
    if child is None:  # `dispatched_refusal` refuses a sub-agent call naming no child before this
        raise ValueError(f"the sub-agent call {call.field} of {session_id} names no child session")
    sub = agent.sub_agent(call.tool)
    prompt = str(call.arguments.get("prompt", "")) if isinstance(call.arguments, dict) else ""
    refusal = _refusal(store, call, sub is None, prompt)
    if sub is None or refusal is not None:
        body = outcome_json(CallState.FAILED, error=refusal, now=time.time(), attempts=0)
        event = {"call_id": call.call_id, "tool": call.tool, "state": CallState.FAILED.value}
        return ChildRun(child, finished=store.record_result(session_id, call.field, body, event))
    priority = store.start_child(session_id, call.field, child, sub, UserQuery(text=prompt))
    if priority is not None:
        checkpoint("child_created", store, child)
        if store.header(session_id).status == Status.CANCELLED:
            # Cancelled while the child was being made: the cancel may have looked for children
            # before this one was listed, so it is cancelled here.
            store.cancel(child)
            return ChildRun(child)
        _recheck_later(store, session_id, call)
        return ChildRun(child, started=True, version=1, priority=priority)
    finished = settle_parent(store, store.header(child))
    if finished is None:
        _recheck_later(store, session_id, call)
    return ChildRun(child, finished=finished)


def _refusal(store: Store, call: TrackedCall, unknown: bool, prompt: str) -> str | None:
    """Why the call starts no child: the spec changed under it (cannot happen for a stored spec,
    say so anyway), or the model's prompt is larger than a person may send (AGENTS_MAX_PROMPT_BYTES)."""
    if unknown:
        return f"no sub-agent for {call.tool}"
    size, limit = len(prompt.encode(errors="surrogatepass")), store.settings.max_prompt_bytes
    if size > limit:
        return f"the prompt is {size} bytes, more than the limit of {limit} (AGENTS_MAX_PROMPT_BYTES)"
    return None


def _recheck_later(store: Store, session_id: str, call: TrackedCall) -> None:
    """The child carries the call on and its end records it at once: the sweeper publishes the
    call again only after AGENTS_LOST_GRACE (a worker that died between the child's end and that
    record), not every AGENTS_OWED_GRACE for as long as the child runs or waits on a person."""
    store.recheck_call_later(session_id, call.field, store.settings.lost_grace)


def child_outcome(child: SessionHeader) -> str | None:
    """The outcome a parent's call records for its ended child (None while the child goes on)."""
    now = time.time()
    meta = CallMeta(child=child.session_id)
    if child.status == Status.COMPLETED:
        return outcome_json(CallState.COMPLETED, result=child.response or "", now=now, attempts=1, meta=meta)
    if child.status == Status.FAILED:
        why = child.error.message if child.error else "it failed"
        text = f"the sub-agent {child.agent_slug!r} (session {child.session_id}) failed: {why}"
        return outcome_json(CallState.FAILED, error=text, now=now, attempts=1, meta=meta)
    if child.status == Status.CANCELLED:
        text = f"the sub-agent {child.agent_slug!r} (session {child.session_id}) was cancelled"
        return outcome_json(CallState.FAILED, error=text, now=now, attempts=1, meta=meta)
    return None


def settle_parent(store: Store, child: SessionHeader) -> Finished | None:
    """Record an ended child's outcome into its parent's call (first writer wins); None when the
    session has no parent or has not ended. The parent is woken as by any last finished call."""
    if child.parent is None or child.parent_call is None:
        return None
    body = child_outcome(child)
    if body is None:
        return None
    state = "completed" if child.status == Status.COMPLETED else "failed"
    event = {"call_id": "", "child": child.session_id, "state": state}
    finished = store.record_result(child.parent, child.parent_call, body, event)
    if finished.woken:
        checkpoint("parent_woken", store, child.parent)
    return finished
