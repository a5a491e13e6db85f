"""A sub-agent call's run on the tools queue, against real Redis: it starts the child once, finds
an ended child and records its end into the call (what recovers a worker that died before doing
so), turns a failed or cancelled child into a failed call, and cancels a child it made while its
parent was being cancelled."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from celery_agents.drivers.celery import settled
from celery_agents.model import CallState, ErrorInfo, State, UserQuery
from celery_agents.runtime import run_call, run_step
from celery_agents.store import Store
from celery_agents.tools.resolve import parse_agent
from tests.scheduler.fakes import RecordingTools, ScriptedLlm, llm_turn

BOSS = {"slug": "boss", "model": "fake/m", "subAgents": [{"slug": "helper", "model": "fake/m"}]}


def delegating(store: Store, drive: str = "auto", prompt: str = "help") -> tuple[str, str]:
    """A session whose model delegated once, its call dispatched: (session id, the call's field)."""
    h = store.create_session(parse_agent(BOSS), UserQuery(text="go"), drive=drive)
    llm = ScriptedLlm(llm_turn(("c1", "prompt_agent_helper", json.dumps({"prompt": prompt}))))
    run_step(store, h.session_id, 1, llm=llm, tools=RecordingTools(), owner="w")
    [call] = run_step(store, h.session_id, 2, llm=llm, tools=RecordingTools(), owner="w").dispatch
    return h.session_id, call.field


def test_a_child_that_ended_unrecorded_is_recorded_by_the_next_run_and_wakes_the_parent(store: Store) -> None:
    sid, field = delegating(store)
    ran = run_call(store, sid, field, RecordingTools(), "t", "runAsync")
    assert ran.child is not None
    child = ran.child[0]
    run_step(store, child, 1, llm=ScriptedLlm(llm_turn(text="the answer")), tools=RecordingTools(), owner="w")
    assert store.header(child).state == State.COMPLETED
    # The worker that committed the child's last step died before telling the parent.
    again = run_call(store, sid, field, RecordingTools(), "t", "runAsync")
    assert again.finished is not None and again.finished.woken
    [call] = store.calls(sid)
    assert (call.state, call.result) == (CallState.COMPLETED, "the answer")
    assert store.header(sid).state == State.READY
    assert run_call(store, sid, field, RecordingTools(), "t", "runAsync").status == "already"


@pytest.mark.parametrize("end", ["failed", "cancelled"])
def test_a_child_that_fails_or_is_cancelled_is_a_failed_call(store: Store, end: str) -> None:
    sid, field = delegating(store)
    ran = run_call(store, sid, field, RecordingTools(), "t", "runAsync")
    assert ran.child is not None
    child = ran.child[0]
    if end == "failed":
        store.fail_step(child, 1, ErrorInfo(code="auth", message="bad key"), "w")
    else:
        store.cancel(child)
    run_call(store, sid, field, RecordingTools(), "t", "runAsync")
    [call] = store.calls(sid)
    assert call.state == CallState.FAILED and child in (call.error or "")
    assert ("bad key" if end == "failed" else "was cancelled") in (call.error or "")


def test_a_child_made_while_its_parent_is_cancelled_is_cancelled_too(store: Store, monkeypatch: Any) -> None:
    sid, field = delegating(store)
    real = store.start_child

    def cancel_first(*args: Any) -> bool:
        made = real(*args)
        store.cancel(sid)  # the cancel lands between the child's creation and the parent's check
        return made

    monkeypatch.setattr(store, "start_child", cancel_first)
    ran = run_call(store, sid, field, RecordingTools(), "t", "runAsync")
    assert ran.child is None, "no first step is published for it"
    [child] = store.children(sid)
    assert store.header(child).state == State.CANCELLED


def test_a_call_whose_child_goes_on_is_looked_at_again_only_after_the_lost_grace(store: Store) -> None:
    sid, field = delegating(store)
    assert run_call(store, sid, field, RecordingTools(), "t", "runAsync").child is not None
    now = store.server_time()
    settings = store.settings
    assert store.dispatched_due(now + settings.owed_grace) == [], "not republished at every sweep"
    due = store.dispatched_due(now + settings.lost_grace + 1)
    assert [(d.session_id, d.field) for d in due] == [(sid, field)], "but still recovered in the end"


def test_a_model_cannot_give_a_child_a_prompt_larger_than_a_user_may_send(store: Store) -> None:
    small = dataclasses.replace(store.settings, max_prompt_bytes=100)
    limited = Store(store.client, small)
    sid, field = delegating(limited, prompt="x" * 101)
    ran = run_call(limited, sid, field, RecordingTools(), "t", "runAsync")
    assert ran.child is None and limited.children(sid) == []
    [call] = limited.calls(sid)
    assert call.state == CallState.FAILED and "AGENTS_MAX_PROMPT_BYTES" in (call.error or "")


def test_a_driven_parent_whose_child_is_listed_but_not_made_yet_is_not_settled(store: Store) -> None:
    sid, _ = delegating(store)
    [call] = store.calls(sid)
    # start_child lists the child first, then makes it: `agents run` may look in between.
    store.client.sadd(store.keys.children(sid), str(call.meta.child))
    assert settled(store, sid, None) is False


def test_a_deleted_child_leaves_its_parents_list_of_children(store: Store) -> None:
    sid, field = delegating(store)
    ran = run_call(store, sid, field, RecordingTools(), "t", "runAsync")
    assert ran.child is not None
    child = ran.child[0]
    run_step(store, child, 1, llm=ScriptedLlm(llm_turn(text="the answer")), tools=RecordingTools(), owner="w")
    assert store.children(sid) == [child]
    store.delete_session(child)
    assert store.children(sid) == []
    assert store.tree(sid) == [sid]
