"""Whether a dispatched call may run in a lane, judged by the verified spec's policy
(`model.policy.disposition_for` says which disposition a call gets)."""

from __future__ import annotations

from celery_agents.model import AgentSpec, Lane, TrackedCall, child_session_id
from celery_agents.model.policy import disposition_for


def dispatched_refusal(
    agent: AgentSpec, session_id: str, call: TrackedCall, lane: Lane, granted: bool = False, decided: bool = False
) -> str | None:
    """Why a dispatched call must not run in `lane`, judged by the verified spec alone; None: it may.

    A stored call record is written by whoever can write Redis, so it is never trusted on its own:
    its tool must be one the spec declares, the disposition the spec's policy gives the call (for
    the arguments the model sent) must be the record's, and the lane asking to run it must be the
    one that disposition runs in. An approval gate runs in the lane of its `then` once a decision
    approved it (`decided`: the approval recorded on its token, store/ledger.py `decision_of`; what
    the call's record or results say counts for nothing), or when the session holds a grant for
    the tool (`granted`). A sub-agent call runs as its child session (the tools lane) once
    dispatched — by its step, or, when a rule defers it first, once `decided` — and its child is
    the one derived from the call. A call the policy runs inline, or whose result a person
    supplies, never runs here."""
    policy = disposition_for(agent, call.tool, call.arguments)
    chosen, then = policy.tag, policy.then.tag if policy.then is not None else None
    name = call.tool[:64]
    expected: str | None
    if agent.sub_agent(call.tool) is not None:
        expected = "runAsync"
        if call.meta.child != child_session_id(session_id, call.field):
            return "its child session is not the one derived from the call"
        if chosen == "defer" and not decided:
            return "it waits for a decision on its token, and none approved it"
    elif agent.tool(call.tool) is None:
        return f"the agent declares no tool {name!r}"
    elif then is not None and granted and call.disposition == then:
        chosen, expected = then, then
    elif then is not None:
        if call.disposition == "defer" and call.then != then:
            return f"the stored call's gate says {call.then}, and the agent's policy gives {name} defer then {then}"
        if call.disposition == "defer" and not decided:
            return "it waits for a decision on its token, and none approved it"
        expected = "runIsolated" if then == "runIsolated" else "runAsync"
    else:
        expected = chosen if chosen in ("runAsync", "runIsolated") else None
    if call.disposition != chosen:
        return f"the stored call says {call.disposition}, and the agent's policy gives {name} {chosen}"
    if expected != lane:
        how = {"runSync": "runs in its step", "defer": "has its result supplied by a person"}.get(chosen)
        return f"the agent's policy gives {name} {chosen}, which {how or 'runs in its own lane'}, not {lane}"
    return None
