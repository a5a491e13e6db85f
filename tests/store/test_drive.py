"""Pausing, resuming and explicit steps: set_drive and step_through (`prepare_step`)."""

from __future__ import annotations

import pytest

from celery_agents.errors import SessionNotAdvanceable, UnknownSession
from celery_agents.model import ErrorInfo, State, Status
from celery_agents.scheduler import LlmFailure
from celery_agents.store import Store
from tests.scheduler.fakes import ScriptedLlm, llm_turn, make_agent
from tests.store.scenario import AGENT, begin, commit, decide, start, step, waiting_on

SHORT = make_agent(executionMode="asynchronous", maxSteps=2)


def owed(store: Store) -> list[str]:
    return store.owed(older_than=9e9)


def stopped_by_max_steps(store: Store, drive: str = "manual") -> str:
    sid = start(store, agent=SHORT, drive=drive)
    step(store, sid, llm=ScriptedLlm(llm_turn(("c1", "sync_a", "{}"))))
    step(store, sid)
    step(store, sid, llm=ScriptedLlm())  # the third step hits maxSteps=2 before calling the model
    h = store.header(sid)
    assert h.status == Status.FAILED and h.error is not None and h.error.code == "max_steps"
    return sid


def test_pause_stops_owing_steps_and_resume_owes_one_again(any_store: Store) -> None:
    store = any_store
    sid = start(store, drive="auto", owe=True)
    assert store.set_drive(sid, "manual") == (1, False)
    assert store.header(sid).drive == "manual"
    assert owed(store) == []
    assert store.set_drive(sid, "auto") == (1, True)
    assert store.header(sid).drive == "auto"
    assert owed(store) == [sid]
    types = [e["type"] for e in store.read_events(sid)]
    assert types[-2:] == ["paused", "resumed"]


def test_resuming_a_waiting_session_owes_nothing_until_its_calls_finish(any_store: Store) -> None:
    store = any_store
    sid, _ = waiting_on(store, ("c1", "async_t"))
    version, is_owed = store.set_drive(sid, "auto")
    assert (version, is_owed) == (3, False)
    assert store.header(sid).state == State.WAITING
    assert owed(store) == []
    res = store.record_result(sid, store.calls(sid)[0].field, '{"state": "completed", "result": 1}', {})
    assert res.woken and owed(store) == [sid]


def test_a_pause_during_a_step_holds_after_its_commit(any_store: Store) -> None:
    store = any_store
    sid = start(store, drive="auto", owe=True)
    loaded = begin(store, sid)
    store.set_drive(sid, "manual")
    t = decide(store, loaded, llm=ScriptedLlm(llm_turn(("c1", "sync_a", "{}"))))
    assert commit(store, sid, loaded, t).outcome == "ok"
    assert owed(store) == [], "the paused session is not driven on"
    assert store.header(sid).drive == "manual"


def test_resuming_a_failed_session_makes_it_active(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    step(store, sid, llm=ScriptedLlm(LlmFailure("auth", "bad key", transient=False)))
    assert store.header(sid).status == Status.FAILED
    assert store.set_drive(sid, "auto") == (2, True)
    h = store.header(sid)
    assert (h.status, h.state, h.error, h.step_limit) == (Status.ACTIVE, State.READY, None, AGENT.max_steps)
    assert owed(store) == [sid]


def test_resuming_after_max_steps_grants_another_max_steps(any_store: Store) -> None:
    store = any_store
    sid = stopped_by_max_steps(store)
    assert store.header(sid).step_limit == 2
    store.set_drive(sid, "auto")
    h = store.header(sid)
    assert (h.status, h.state, h.step_limit, h.head) == (Status.ACTIVE, State.READY, 4, "UserTurn")
    step(store, sid, llm=ScriptedLlm(llm_turn(text="finally")))
    assert store.header(sid).status == Status.COMPLETED


def test_pausing_a_failed_session_keeps_it_failed(any_store: Store) -> None:
    store = any_store
    sid = stopped_by_max_steps(store)
    store.set_drive(sid, "manual")
    assert store.header(sid).status == Status.FAILED


@pytest.mark.parametrize("end", ["completed", "cancelled"])
def test_an_ended_session_cannot_be_resumed_or_paused(any_store: Store, end: str) -> None:
    store = any_store
    sid = start(store)
    if end == "completed":
        step(store, sid, llm=ScriptedLlm(llm_turn(text="done")))
    else:
        store.cancel(sid)
    for drive in ("auto", "manual"):
        with pytest.raises(SessionNotAdvanceable):
            store.set_drive(sid, drive)
        with pytest.raises(SessionNotAdvanceable):
            store.prepare_step(sid)
    assert owed(store) == []


def test_drive_of_an_unknown_session(any_store: Store) -> None:
    with pytest.raises(UnknownSession):
        any_store.set_drive("nosuchsession", "auto")
    with pytest.raises(UnknownSession):
        any_store.prepare_step("nosuchsession")


def test_prepare_step_returns_the_version_to_step_at(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    assert store.prepare_step(sid) == 1
    step(store, sid, llm=ScriptedLlm(llm_turn(("c1", "sync_a", "{}"))))
    assert store.prepare_step(sid) == 2
    assert store.header(sid).status == Status.ACTIVE


def test_prepare_step_reactivates_a_failed_session_and_grants_steps(any_store: Store) -> None:
    store = any_store
    sid = stopped_by_max_steps(store)
    version = store.prepare_step(sid)
    h = store.header(sid)
    assert version == h.version
    assert (h.status, h.state, h.step_limit, h.error) == (Status.ACTIVE, State.READY, 4, None)
    assert store.begin_step(sid, version, "w").outcome == "ok"


def test_prepare_step_after_an_internal_failure_keeps_the_step_limit(any_store: Store) -> None:
    store = any_store
    sid = start(store, agent=SHORT)
    begin(store, sid)
    store.fail_step(sid, 1, ErrorInfo(code="internal_error", message="boom"), "w1")
    store.prepare_step(sid)
    h = store.header(sid)
    assert (h.status, h.state, h.step_limit) == (Status.ACTIVE, State.READY, 2)
