"""What the scheduler makes of a sub-agent call: a running call naming its child session (an id
derived from the call), a failed call when the prompt is missing; and of queued user messages."""

from __future__ import annotations

from celery_agents.model import CallState, UserQuery, child_session_id
from celery_agents.scheduler import Ports, advance
from celery_agents.tools.resolve import parse_agent
from tests.scheduler.fakes import RecordingTools, ScriptedLlm, ask, llm_turn, snapshot
from tests.store.scenario import RealIds, WallClock

BOSS = parse_agent(
    {
        "slug": "boss",
        "model": "fake/model",
        "executionMode": "synchronous",
        "subAgents": [{"slug": "helper", "model": "fake/model", "description": "helps"}],
    }
)


def ports(llm: ScriptedLlm | None = None) -> Ports:
    return Ports(llm=llm or ScriptedLlm(), tools=RecordingTools(), clock=WallClock(), ids=RealIds())


def test_a_sub_agent_call_waits_for_a_child_whose_id_the_call_decides() -> None:
    turn = llm_turn(("c1", "prompt_agent_helper", '{"prompt": "look it up"}'))
    t = advance(snapshot(BOSS, [ask(), turn]), ports())
    (call,) = t.calls
    assert (call.state, call.disposition, t.state.value) == (CallState.RUNNING, "runAsync", "waiting")
    assert call.meta.child == child_session_id("sess1", call.field) == child_session_id("sess1", "1:0")
    assert t.dispatch == [call], "even in synchronous mode the child runs on its own"


def test_a_sub_agent_call_without_a_prompt_fails_and_the_model_is_told_why() -> None:
    turn = llm_turn(("c1", "prompt_agent_helper", '{"task": "x"}'))
    t = advance(snapshot(BOSS, [ask(), turn]), ports())
    (call,) = t.calls
    assert call.state == CallState.FAILED and "prompt" in (call.error or "")


def test_the_model_is_offered_the_sub_agent_tool() -> None:
    llm = ScriptedLlm(llm_turn(text="hi"))
    advance(snapshot(BOSS, [ask()]), ports(llm))
    assert [t["function"]["name"] for t in llm.requests[0].tools] == ["prompt_agent_helper"]


def test_queued_messages_follow_the_folded_results_each_as_its_own_user_message() -> None:
    turn = llm_turn(("c1", "prompt_agent_helper", '{"prompt": "x"}'))
    first = advance(snapshot(BOSS, [ask(), turn]), ports())
    done = [c.model_copy(update={"state": CallState.COMPLETED, "result": "found"}) for c in first.calls]
    snap = snapshot(BOSS, [ask(), turn], partial=True, calls=done)
    snap.inbox = [UserQuery(text="one"), UserQuery(text="two")]
    llm = ScriptedLlm(llm_turn(text="ok"))
    t = advance(snap, ports(llm))
    assert t.inbox_taken == 2
    roles = [(m["role"], m.get("content")) for m in llm.requests[0].messages[-3:]]
    assert roles == [("tool", "found"), ("user", "one"), ("user", "two")]
