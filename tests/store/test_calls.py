"""Outcomes of calls that finish after their step: record_result, complete_token, expire_call,
cancel_session, and the pending views; on real Redis and on fakeredis[lua]."""

from __future__ import annotations

import json
import time

import pytest

from celery_agents.errors import (
    SessionNotAdvanceable,
    TokenAlreadyCompleted,
    TokenCancelled,
    TokenExpired,
    UnknownSession,
    UnknownToken,
)
from celery_agents.model import CallState, State, Status
from celery_agents.store import Store, completion_json, new_token, outcome_json
from tests.scheduler.fakes import ScriptedLlm, llm_turn, make_agent
from tests.store.scenario import AGENT, begin, start, step, token_hash, token_of, waiting_on

DAY = 86400.0


def done(result: object) -> str:
    return outcome_json(CallState.COMPLETED, result=result, now=time.time(), attempts=1)


def approve(result: object, by: str = "ops") -> str:
    return completion_json(result, is_error=False, by=by, now=time.time())


def field_of(store: Store, sid: str, call_id: str) -> str:
    return next(c.field for c in store.calls(sid) if c.call_id == call_id)


def call_state(store: Store, sid: str, call_id: str) -> CallState:
    return next(c.state for c in store.calls(sid) if c.call_id == call_id)


# -- record_result -------------------------------------------------------------------------------


def test_record_result_counts_down_and_the_last_result_readies_the_session(any_store: Store) -> None:
    store = any_store
    sid, _ = waiting_on(store, ("c1", "async_t"), ("c2", "isolated_t"))
    first = store.record_result(sid, field_of(store, sid, "c2"), done("two"), {"call_id": "c2"})
    assert (first.status, first.remaining, first.woken) == ("ok", 1, False)
    assert store.header(sid).state == State.WAITING
    last = store.record_result(sid, field_of(store, sid, "c1"), done("one"), {"call_id": "c1"})
    assert (last.status, last.remaining, last.woken, last.version) == ("ok", 0, False, 3)
    h = store.header(sid)
    assert (h.state, h.head, h.version) == (State.READY, "PartialUserTurn", 3), "results do not bump the version"
    assert store.owed(older_than=9e9) == [], "manual drive: nothing wakes by itself"
    assert store.pending_view(sid) == []
    assert "tool_finished" in [e["type"] for e in store.read_events(sid)]


def test_in_auto_drive_only_the_last_result_wakes_the_session(any_store: Store) -> None:
    store = any_store
    sid, _ = waiting_on(store, ("c1", "async_t"), ("c2", "async_t"), drive="auto")
    assert store.owed(older_than=9e9) == []
    first = store.record_result(sid, field_of(store, sid, "c1"), done(1), {})
    assert (first.remaining, first.woken) == (1, False)
    assert store.owed(older_than=9e9) == []
    last = store.record_result(sid, field_of(store, sid, "c2"), done(2), {})
    assert (last.remaining, last.woken) == (0, True)
    assert store.owed(older_than=9e9) == [sid]


def test_record_result_first_writer_wins(any_store: Store) -> None:
    store = any_store
    sid, _ = waiting_on(store, ("c1", "async_t"), ("c2", "async_t"))
    f = field_of(store, sid, "c1")
    assert store.record_result(sid, f, done("first"), {}).status == "ok"
    assert store.record_result(sid, f, done("second"), {}).status == "already"
    [c1] = [c for c in store.calls(sid) if c.call_id == "c1"]
    assert c1.result == "first"
    assert len(store.pending_view(sid)) == 1


def test_record_result_for_an_unknown_call_or_session(any_store: Store) -> None:
    store = any_store
    sid, _ = waiting_on(store, ("c1", "async_t"))
    assert store.record_result(sid, "9:9", done(1), {}).status == "unknown"
    assert store.record_result("nosuchsession", "1:0", done(1), {}).status == "missing"
    assert len(store.pending_view(sid)) == 1


def test_the_folded_results_reach_the_next_step(any_store: Store) -> None:
    store = any_store
    sid, _ = waiting_on(store, ("c1", "async_t"), ("c2", "sync_a"))
    store.record_result(sid, field_of(store, sid, "c1"), done({"temp": 21}), {})
    llm = ScriptedLlm(llm_turn(text="21 degrees"))
    step(store, sid, llm=llm)
    tool_msgs = [m for m in llm.requests[0].messages if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in tool_msgs] == [
        ("c1", '{"temp": 21}'),
        ("c2", "sync_a ok"),
    ]
    assert store.header(sid).status == Status.COMPLETED


# -- complete_token ------------------------------------------------------------------------------


def test_complete_token_records_the_result_and_who_completed_it(any_store: Store) -> None:
    store = any_store
    sid, calls = waiting_on(store, ("c1", "defer_t"), ("c2", "async_t"))
    token = token_of(calls, "c1")
    outcome, version = store.complete_token(token, approve({"approved": True}, by="alice"), by="alice")
    assert (outcome.session_id, outcome.call_id, outcome.remaining, outcome.woken) == (sid, "c1", 1, False)
    assert outcome.accepted and version == 3
    info = token_hash(store, token)
    assert (info["state"], info["completed_by"]) == ("completed", "alice")
    [c1] = [c for c in store.calls(sid) if c.call_id == "c1"]
    assert (c1.state, c1.result, c1.completed_by) == (CallState.COMPLETED, {"approved": True}, "alice")
    assert not store.client.zscore(store.keys.deadlines, f"{sid} {c1.field}"), "the deadline is dropped"
    assert "token_completed" in [e["type"] for e in store.read_events(sid)]


def test_completing_the_last_call_wakes_an_auto_session(any_store: Store) -> None:
    store = any_store
    sid, calls = waiting_on(store, ("c1", "defer_t"), drive="auto")
    outcome, _ = store.complete_token(token_of(calls, "c1"), approve("yes"))
    assert (outcome.remaining, outcome.woken) == (0, True)
    assert store.owed(older_than=9e9) == [sid]
    assert store.header(sid).state == State.READY


def test_completing_with_an_error_fails_the_call(any_store: Store) -> None:
    store = any_store
    sid, calls = waiting_on(store, ("c1", "defer_t"))
    store.complete_token(
        token_of(calls, "c1"),
        completion_json("rejected by finance", is_error=True, by="bob", now=time.time()),
    )
    [c1] = store.calls(sid)
    assert (c1.state, c1.error) == (CallState.FAILED, "rejected by finance")


def test_a_token_completes_once(any_store: Store) -> None:
    store = any_store
    sid, calls = waiting_on(store, ("c1", "defer_t"))
    token = token_of(calls, "c1")
    store.complete_token(token, approve("first"))
    with pytest.raises(TokenAlreadyCompleted) as info:
        store.complete_token(token, approve("second"))
    assert info.value.code == "token_already_completed" and info.value.exit_code == 5
    assert store.calls(sid)[0].result == "first"


@pytest.mark.parametrize("token", ["garbage", "", "nosuchsession.AAAAAAAAAAAAAAAAAAAAAAAA"])
def test_unknown_tokens_are_refused(any_store: Store, token: str) -> None:
    with pytest.raises(UnknownToken) as info:
        any_store.complete_token(token, approve(1))
    assert info.value.exit_code == 3


def test_a_made_up_token_for_a_real_session_is_unknown_and_changes_nothing(any_store: Store) -> None:
    store = any_store
    sid, _ = waiting_on(store, ("c1", "defer_t"))
    with pytest.raises(UnknownToken):
        store.complete_token(new_token(sid), approve(1))
    assert len(store.pending_view(sid)) == 1


def test_a_token_past_its_deadline_is_expired_not_completed(any_store: Store) -> None:
    store = any_store
    sid, calls = waiting_on(store, ("c1", "defer_t"), ("c2", "async_t"))
    token = token_of(calls, "c1")
    with pytest.raises(TokenExpired) as info:
        store.complete_token(token, approve("late"), now=time.time() + DAY + 60)
    assert info.value.code == "token_expired"
    [c1] = [c for c in store.calls(sid) if c.call_id == "c1"]
    assert c1.state == CallState.EXPIRED and c1.result is None
    assert [p.call_id for p in store.pending_view(sid)] == ["c2"]
    with pytest.raises(TokenExpired):
        store.complete_token(token, approve("later still"))


def test_a_token_of_a_cancelled_session_is_cancelled(any_store: Store) -> None:
    store = any_store
    sid, calls = waiting_on(store, ("c1", "defer_t"))
    store.cancel(sid)
    with pytest.raises(TokenCancelled) as info:
        store.complete_token(token_of(calls, "c1"), approve("too late"))
    assert info.value.code == "token_cancelled"
    assert store.calls(sid)[0].state == CallState.CANCELLED


# -- expire_call ---------------------------------------------------------------------------------


def test_expire_call_waits_for_the_deadline_then_tells_the_model(any_store: Store) -> None:
    store = any_store
    sid, calls = waiting_on(store, ("c1", "defer_t"), drive="auto")
    f = calls[0].field
    assert store.due_deadlines(time.time()) == []
    assert store.expire_call(sid, f).status == "early"
    assert call_state(store, sid, "c1") == CallState.DEFERRED
    later = time.time() + DAY + 1
    assert store.due_deadlines(later) == [(sid, f)]
    res = store.expire_call(sid, f, now=later)
    assert (res.status, res.remaining, res.woken) == ("ok", 0, True)
    assert call_state(store, sid, "c1") == CallState.EXPIRED
    assert token_hash(store, token_of(calls, "c1"))["state"] == "expired"
    assert store.due_deadlines(later) == []
    assert store.owed(older_than=9e9) == [sid]
    llm = ScriptedLlm(llm_turn(text="no approval came"))
    step(store, sid, llm=llm)
    [tool_msg] = [m for m in llm.requests[0].messages if m["role"] == "tool"]
    assert "expired" in tool_msg["content"] and "a human approves" in tool_msg["content"]


def test_expiring_a_completed_call_changes_nothing(any_store: Store) -> None:
    store = any_store
    sid, calls = waiting_on(store, ("c1", "defer_t"))
    store.complete_token(token_of(calls, "c1"), approve("in time"))
    res = store.expire_call(sid, calls[0].field, now=time.time() + DAY + 1)
    assert res.status == "gone"
    assert store.calls(sid)[0].result == "in time"


# -- cancel_session ------------------------------------------------------------------------------


def test_cancel_kills_tokens_clears_pending_and_fences_queued_steps(any_store: Store) -> None:
    store = any_store
    sid, calls = waiting_on(store, ("c1", "defer_t"), ("c2", "async_t"), ("c3", "sync_a"), drive="auto")
    store.client.zadd(store.keys.owed, {sid: 1})
    version = store.cancel(sid)
    assert version == 4
    h = store.header(sid)
    assert (h.status, h.state, h.version, h.drive) == (Status.CANCELLED, State.CANCELLED, 4, "manual")
    assert token_hash(store, token_of(calls, "c1"))["state"] == "cancelled"
    assert [c.state for c in store.calls(sid)] == [
        CallState.CANCELLED,
        CallState.CANCELLED,
        CallState.COMPLETED,
    ]
    assert store.pending_view(sid) == [] and store.pending_view() == []
    assert not store.client.exists(store.keys.pending(sid))
    assert store.due_deadlines(time.time() + 2 * DAY) == []
    assert store.owed(older_than=9e9) == []
    assert store.begin_step(sid, 3, "w").outcome == "ended"
    assert [s.session_id for s in store.list_sessions("cancelled")] == [sid]
    assert [e["type"] for e in store.read_events(sid)][-2:] == ["cancelled", "step_skipped"]


def test_cancel_twice_or_unknown(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    store.cancel(sid)
    with pytest.raises(SessionNotAdvanceable):
        store.cancel(sid)
    with pytest.raises(UnknownSession):
        store.cancel("nosuchsession")


def test_an_async_result_after_cancel_changes_nothing(any_store: Store) -> None:
    store = any_store
    sid, _ = waiting_on(store, ("c1", "async_t"), drive="auto")
    f = field_of(store, sid, "c1")
    store.cancel(sid)
    before = store.header(sid)
    late = store.record_result(sid, f, done("finished anyway"), {})
    assert late.status == "already" and not late.woken
    after = store.header(sid)
    assert (after.status, after.state, after.version) == (Status.CANCELLED, State.CANCELLED, before.version)
    assert store.calls(sid)[0].state == CallState.CANCELLED
    assert store.owed(older_than=9e9) == []


# -- pending views and lists ---------------------------------------------------------------------


def test_pending_view_of_one_session_lists_unfinished_calls_in_call_order(any_store: Store) -> None:
    store = any_store
    sid, calls = waiting_on(store, ("c1", "defer_t"), ("c2", "sync_a"), ("c3", "async_t"))
    view = store.pending_view(sid)
    assert [(p.call_id, p.tool, p.disposition, p.state) for p in view] == [
        ("c1", "defer_t", "defer", "deferred"),
        ("c3", "async_t", "runAsync", "queued"),
    ]
    assert view[0].token == token_of(calls, "c1") and view[1].token is None
    assert view[0].reason == "a human approves"
    assert view[0].arguments == {"n": 1}
    assert view[0].expires_at is not None and view[0].expires_at > time.time() + DAY - 60
    assert all(p.session_id == sid for p in view)


def test_pending_view_of_an_unknown_session(any_store: Store) -> None:
    with pytest.raises(UnknownSession):
        any_store.pending_view("nosuchsession")
    assert any_store.pending_view(start(any_store)) == []


def test_global_pending_view_spans_sessions_oldest_first(any_store: Store) -> None:
    store = any_store
    older, _ = waiting_on(store, ("a1", "defer_t"))
    store.client.zadd(store.keys.pending_all, {f"{older} 1:0": 1000})  # make the age difference certain
    newer, _ = waiting_on(store, ("b1", "async_t"), ("b2", "sync_a"))
    assert [(p.session_id, p.call_id) for p in store.pending_view()] == [(older, "a1"), (newer, "b1")]
    store.complete_token(token_of(store.pending_calls(older), "a1"), approve("ok"))
    assert [p.call_id for p in store.pending_view()] == ["b1"]


def test_global_pending_view_keeps_call_order_within_a_session(any_store: Store) -> None:
    store = any_store
    ids = [f"c{i:02d}" for i in range(12)]
    sid, _ = waiting_on(store, *[(cid, "defer_t") for cid in ids])
    assert [p.call_id for p in store.pending_view(sid)] == ids
    assert [p.call_id for p in store.pending_view()] == ids


def test_the_global_pending_view_does_not_scan_the_keyspace(store: Store) -> None:
    for _ in range(3):
        waiting_on(store, ("c1", "defer_t"))

    def scans() -> int:
        stats = store.client.info("commandstats")
        return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("scan", "keys"))

    before = scans()
    assert len(store.pending_view()) == 3
    assert scans() == before


def test_list_sessions_by_state_newest_first(any_store: Store) -> None:
    store = any_store
    t0 = time.time()
    ready = start(store, now=t0 + 1)
    waiting = start(store, now=t0 + 2)
    step(store, waiting, llm=ScriptedLlm(llm_turn(("c1", "defer_t", "{}"))), now=t0 + 3)
    step(store, waiting, now=t0 + 4)
    completed = start(store, now=t0 + 5)
    step(store, completed, llm=ScriptedLlm(llm_turn(text="done")), now=t0 + 6)
    assert [s.session_id for s in store.list_sessions("ready")] == [ready]
    assert [s.session_id for s in store.list_sessions("waiting")] == [waiting]
    assert [s.session_id for s in store.list_sessions("completed")] == [completed]
    assert [s.session_id for s in store.list_sessions()] == [completed, waiting, ready]
    assert [s.session_id for s in store.list_sessions(limit=1)] == [completed]
    assert store.list_sessions("failed") == []


def test_a_session_leaves_the_state_index_it_left(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    step(store, sid, llm=ScriptedLlm(llm_turn(("c1", "defer_t", "{}"))))
    assert [s.session_id for s in store.list_sessions("tools")] == [sid]
    step(store, sid)
    assert store.list_sessions("tools") == [] and store.list_sessions("ready") == []
    assert [s.session_id for s in store.list_sessions("waiting")] == [sid]


def test_results_survive_a_fresh_store_on_the_same_redis(any_store: Store) -> None:
    store = any_store
    sid, calls = waiting_on(store, ("c1", "defer_t"))
    store.complete_token(token_of(calls, "c1"), approve({"ok": 1}))
    other = type(store)(store.client, store.settings)
    loaded = begin(other, sid, "elsewhere")
    assert [(c.call_id, c.state, c.result) for c in loaded.calls] == [("c1", CallState.COMPLETED, {"ok": 1})]
    assert other.agent(loaded.header.agent_hash) == AGENT
    assert json.loads(store.client.get(store.keys.agent(AGENT.content_hash())) or "{}")["slug"] == AGENT.slug


def test_text_beyond_ascii_survives_every_script(any_store: Store) -> None:
    store = any_store
    agent = make_agent(
        {"rules": [{"tool": "defer_t", "disposition": {"tag": "defer", "reason": "approbation 😀 requise"}}]},
        executionMode="asynchronous",
    )
    sid = start(store, agent=agent, text="Quel temps fait-il à Zürich ? ☀️")
    step(store, sid, llm=ScriptedLlm(llm_turn(("c1", "defer_t", '{"ville": "Zürich 😀"}'), text="Je vérifie…")))
    calls = step(store, sid).transition.calls
    [pending] = store.pending_view(sid)
    assert (pending.arguments, pending.reason) == ({"ville": "Zürich 😀"}, "approbation 😀 requise")
    assert token_hash(store, token_of(calls, "c1"))["reason"] == "approbation 😀 requise"
    store.complete_token(token_of(calls, "c1"), approve("oui 😀"))
    step(store, sid, llm=ScriptedLlm(llm_turn(text="Il fait 21 °C ☀️")))
    assert store.header(sid).response == "Il fait 21 °C ☀️"
    assert store.calls(sid)[0].result == "oui 😀"
    [created] = [e for e in store.read_events(sid) if e["type"] == "token_created"]
    assert created["reason"] == "approbation 😀 requise"


def test_a_failed_session_can_be_cancelled(any_store: Store) -> None:
    from celery_agents.scheduler import LlmFailure

    store = any_store
    sid = start(store)
    step(store, sid, llm=ScriptedLlm(LlmFailure("auth", "bad key", transient=False)))
    store.cancel(sid)
    h = store.header(sid)
    assert (h.status, h.state) == (Status.CANCELLED, State.CANCELLED)
    assert store.list_sessions("failed") == []


def test_a_dispatched_call_reads_queued_until_a_worker_starts_it(any_store: Store) -> None:
    store = any_store
    sid, _ = waiting_on(store, ("c1", "async_t"), ("c2", "defer_t"))
    f1 = field_of(store, sid, "c1")

    def states() -> dict[str, dict[str, str]]:
        return {
            "session": {p.call_id: p.state for p in store.pending_view(sid)},
            "all": {p.call_id: p.state for p in store.pending_view() if p.session_id == sid},
            "list": {p.call_id: p.state for p in store.live_state([store.header(sid)])[0][0]},
        }

    assert all(v == {"c1": "queued", "c2": "deferred"} for v in states().values()), states()
    # What a worker does when it takes the call (runtime.calls.run_call).
    store.client.set(store.keys.call_started(sid, f1), "worker-1", ex=60)
    assert all(v == {"c1": "running", "c2": "deferred"} for v in states().values()), states()
    assert [c.state for c in store.pending_calls(sid)] == [CallState.RUNNING, CallState.DEFERRED]
