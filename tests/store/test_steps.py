"""Creating sessions and running steps through the store's scripts: create_session, begin_step,
commit_step, end_step, fail_step, journal_put; on real Redis and on fakeredis[lua]."""

from __future__ import annotations

import json
from typing import Any

import pytest

from celery_agents.errors import SessionNotAdvanceable
from celery_agents.model import AgentSpec, CallState, ErrorInfo, LlmTurn, State, Status, UserQuery, UserTurn
from celery_agents.runtime import commit_transition
from celery_agents.store import Begun, LeaseLost, Store
from celery_agents.store.commit import commit_record
from celery_agents.store.records import LeaseRef
from celery_agents.store.store import JOURNAL_TTL_S
from tests.scheduler.fakes import RecordingTools, ScriptedLlm, llm_turn
from tests.store.scenario import AGENT, begin, commit, decide, start, step, token_hash


def event_types(store: Store, sid: str) -> list[str]:
    return [e["type"] for e in store.read_events(sid)]


def in_index(store: Store, key: str, member: str) -> bool:
    return store.client.zscore(key, member) is not None


# -- create_session ------------------------------------------------------------------------------


def test_create_session_stores_header_first_turn_indexes_and_event(any_store: Store) -> None:
    store = any_store
    sid = start(store, text="hello there")
    h = store.header(sid)
    assert (h.version, h.status, h.state, h.head, h.drive, h.steps, h.turn_count) == (
        1,
        Status.ACTIVE,
        State.READY,
        "UserTurn",
        "manual",
        0,
        1,
    )
    assert h.agent_slug == AGENT.slug and h.step_limit == AGENT.max_steps
    assert h.execution_mode == "asynchronous"
    [turn] = store.turns(sid)
    assert isinstance(turn, UserTurn) and turn.query is not None and turn.query.text == "hello there"
    assert in_index(store, store.keys.state_index("ready"), sid)
    assert event_types(store, sid) == ["session_started"]
    assert store.owed(older_than=9e9) == []


def test_create_session_can_owe_the_first_step(any_store: Store) -> None:
    sid = start(any_store, drive="auto", owe=True)
    assert any_store.owed(older_than=9e9) == [sid]
    assert any_store.header(sid).drive == "auto"


def test_the_agent_spec_is_stored_once_by_content_hash(any_store: Store) -> None:
    store = any_store
    a, b = start(store), start(store)
    other = AgentSpec.from_json(json.dumps({**json.loads(AGENT.to_json()), "maxSteps": 7}))
    c = start(store, agent=other)
    hashes = {store.header(s).agent_hash for s in (a, b)}
    assert hashes == {AGENT.content_hash()}
    assert store.header(c).agent_hash == other.content_hash() != AGENT.content_hash()
    agent_keys = [k for k in store.client.keys(f"{store.keys.prefix}:agent:*")]
    assert sorted(agent_keys) == sorted(
        {store.keys.agent(AGENT.content_hash()), store.keys.agent(other.content_hash())}
    )
    # a worker on another machine, with no local file and no cache, reads the spec from Redis
    fresh = Store(store.client, store.settings)
    assert fresh.agent(AGENT.content_hash()) == AGENT
    assert fresh.agent(other.content_hash()).max_steps == 7


def test_creating_an_existing_session_id_is_refused(any_store: Store) -> None:
    sid = start(any_store)
    with pytest.raises(SessionNotAdvanceable):
        any_store.create_session(AGENT, UserQuery(text="again"), session_id=sid)
    assert len(any_store.turns(sid)) == 1


# -- begin_step ----------------------------------------------------------------------------------


def test_begin_step_takes_the_lease_and_returns_what_the_step_needs(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    loaded = store.begin_step(sid, 1, "worker-a", request="r1").loaded
    assert loaded is not None
    assert loaded.header.session_id == sid and loaded.header.version == 1
    assert [t.kind for t in loaded.turns] == ["UserTurn"]
    assert loaded.calls == [] and loaded.journal == {} and loaded.inbox == []
    assert store.lease_holder(sid) == "worker-a"
    assert event_types(store, sid)[-1] == "step_started"


def test_begin_step_returns_the_journal_of_a_tools_step(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    step(store, sid, llm=ScriptedLlm(llm_turn(("c1", "sync_a", "{}"))))
    begin(store, sid, "worker-a")
    store.journal_put(sid, "tool:1:0", "ran once", "worker-a", 2)
    store.client.delete(store.keys.lease(sid))  # worker-a died: the step is redelivered
    assert begin(store, sid, "worker-b").journal == {"tool:1:0": "ran once"}


def test_a_model_step_with_no_message_queued_reads_no_journal(any_store: Store) -> None:
    """Such a step journals nothing (its model answer travels in its commit): a journaled answer is
    not read, the redelivered step asks the model once more."""
    store = any_store
    sid = start(store)
    store.journal_put(sid, "llm:1", "{}", "worker-a", 1)
    assert begin(store, sid, "worker-a").journal == {}


def test_begin_step_takes_the_lease_again_for_its_holder_with_a_fresh_time_to_live(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    begin(store, sid, "worker-a")
    lease = store.keys.lease(sid)
    store.client.pexpire(lease, 1000)
    again = store.begin_step(sid, 1, "worker-a")
    assert again.outcome == "ok" and again.loaded is not None
    assert store.client.pttl(lease) > 1000, "the lease runs its whole time again"
    assert event_types(store, sid)[-2:] == ["step_started", "step_started"]


def test_begin_step_returns_the_newest_batch_with_recorded_outcomes(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    step(store, sid, llm=ScriptedLlm(llm_turn(("c1", "async_t", "{}"), ("c2", "sync_a", "{}"))))
    step(store, sid)
    fields = [c.field for c in store.calls(sid)]
    store.record_result(sid, fields[0], json.dumps({"state": "completed", "result": 42}), {})
    loaded = begin(store, sid)
    assert [(c.call_id, c.state, c.result) for c in loaded.calls] == [
        ("c1", CallState.COMPLETED, 42),
        ("c2", CallState.COMPLETED, "sync_a ok"),
    ]


def test_begin_step_reads_the_newest_batch_only_for_the_step_that_folds_it(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    step(store, sid, llm=ScriptedLlm(llm_turn(("c1", "sync_a", "{}"))))
    step(store, sid)  # the tools step: every call final, head UserTurn
    assert store.header(sid).head == "UserTurn"
    assert begin(store, sid).calls == [], "the model step after the tools step does not read them"


def test_begin_step_refuses_a_stale_version(any_store: Store) -> None:
    sid = start(any_store)
    assert any_store.begin_step(sid, 7, "w") == Begun("stale", detail="1")
    assert any_store.lease_holder(sid) is None
    [skipped] = [e for e in any_store.read_events(sid) if e["type"] == "step_skipped"]
    assert skipped["reason"] == "stale"


def test_begin_step_refuses_while_another_worker_holds_the_lease(any_store: Store) -> None:
    sid = start(any_store)
    begin(any_store, sid, "worker-a")
    assert any_store.begin_step(sid, 1, "worker-b") == Begun("busy", detail="worker-a")
    assert any_store.lease_holder(sid) == "worker-a"
    # the holder itself (a redelivery to the same worker) may go on
    assert any_store.begin_step(sid, 1, "worker-a").outcome == "ok"


def test_begin_step_refuses_an_ended_session(any_store: Store) -> None:
    sid = start(any_store)
    step(any_store, sid, llm=ScriptedLlm(llm_turn(text="done")))
    assert any_store.begin_step(sid, 2, "w") == Begun("ended", detail="completed")


def test_begin_step_on_an_unknown_session(any_store: Store) -> None:
    assert any_store.begin_step("nosuchsession", 1, "w").outcome == "missing"


# -- commit_step ---------------------------------------------------------------------------------


def test_commit_appends_turns_bumps_version_and_releases_the_lease(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    loaded = begin(store, sid)
    t = decide(store, loaded, llm=ScriptedLlm(llm_turn(("c1", "sync_a", "{}"), text="checking")))
    res = commit(store, sid, loaded, t)
    assert (res.outcome, res.version) == ("ok", 2)
    h = store.header(sid)
    assert (h.version, h.head, h.state, h.steps, h.turn_count) == (2, "LlmTurn", State.TOOLS, 1, 2)
    turns = store.turns(sid)
    assert isinstance(turns[1], LlmTurn) and turns[1].text == "checking"
    assert store.lease_holder(sid) is None
    assert in_index(store, store.keys.state_index("tools"), sid)
    assert not in_index(store, store.keys.state_index("ready"), sid)
    types = event_types(store, sid)
    assert types[-2:] == ["llm_called", "step_committed"]


def test_the_commit_of_a_tools_step_clears_its_journal(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    step(store, sid, llm=ScriptedLlm(llm_turn(("c1", "sync_a", "{}"))))
    loaded = begin(store, sid)
    store.journal_put(sid, "tool:1:0", "ran", "w1", 2)
    t = decide(store, loaded)
    assert commit(store, sid, loaded, t).outcome == "ok"
    assert not store.client.exists(store.keys.journal(sid)), "the journal of the committed step is cleared"


def test_the_commit_of_a_step_that_took_queued_messages_clears_its_journal(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    store.send_message(sid, UserQuery(text="and also"))
    step(store, sid, llm=ScriptedLlm(llm_turn(text="both")))
    assert not store.client.exists(store.keys.journal(sid)), "inbox:1 went with the commit"
    assert store.header(sid).inbox_waiting == 0


def test_commit_sums_token_usage_into_the_header(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    step(store, sid, llm=ScriptedLlm(llm_turn(("c1", "sync_a", "{}"))))
    step(store, sid)
    step(store, sid, llm=ScriptedLlm(llm_turn(text="done")))
    usage = store.header(sid).usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (20, 4, 24)


def test_commit_of_a_tools_step_writes_calls_pending_and_tokens(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    step(
        store,
        sid,
        llm=ScriptedLlm(llm_turn(("c1", "sync_a", "{}"), ("c2", "async_t", "{}"), ("c3", "defer_t", '{"amount": 5}'))),
    )
    done = step(store, sid)
    h = store.header(sid)
    assert (h.version, h.head, h.state) == (3, "PartialUserTurn", State.WAITING)
    assert len(store.turns(sid)) == 2, "a partial turn is not appended"
    calls = store.calls(sid)
    assert [(c.call_id, c.state) for c in calls] == [
        ("c1", CallState.COMPLETED),
        ("c2", CallState.RUNNING),
        ("c3", CallState.DEFERRED),
    ]
    assert set(store.client.hkeys(store.keys.pending(sid))) == {"1:1", "1:2"}
    assert set(store.client.zrange(store.keys.pending_all, 0, -1)) == {f"{sid} 1:1", f"{sid} 1:2"}
    token = done.transition.calls[2].token
    assert token is not None
    info = token_hash(store, token)
    assert (info["state"], info["call_id"], info["field"], info["reason"]) == (
        "pending",
        "c3",
        "1:2",
        "a human approves",
    )
    deadline = store.client.zscore(store.keys.deadlines, f"{sid} 1:2")
    assert deadline == int(info["expires_ms"])
    assert in_index(store, store.keys.state_index("waiting"), sid)
    assert "token_created" in event_types(store, sid)


def test_commit_in_auto_drive_owes_the_next_step_and_manual_does_not(any_store: Store) -> None:
    store = any_store
    auto, manual = start(store, drive="auto", owe=True), start(store)
    for sid in (auto, manual):
        step(store, sid, llm=ScriptedLlm(llm_turn(("c1", "sync_a", "{}"))))
    assert store.owed(older_than=9e9) == [auto]
    assert store.client.hget(store.keys.meta(auto), "owed_version") == "2"
    # waiting on an async call: nothing is owed until the call finishes
    step(store, auto)
    step(store, auto, llm=ScriptedLlm(llm_turn(("c2", "async_t", "{}"))))
    step(store, auto)
    assert store.header(auto).state == State.WAITING
    assert store.owed(older_than=9e9) == []


def test_commit_of_a_finished_session_clears_the_outbox(any_store: Store) -> None:
    store = any_store
    sid = start(store, drive="auto", owe=True)
    done = step(store, sid, llm=ScriptedLlm(llm_turn(text="Sunny.")))
    assert done.result is not None
    h = store.header(sid)
    assert (h.status, h.state, h.response) == (Status.COMPLETED, State.COMPLETED, "Sunny.")
    assert store.owed(older_than=9e9) == []
    assert in_index(store, store.keys.state_index("completed"), sid)
    assert store.list_sessions("completed")[0].session_id == sid


def test_commit_refuses_a_stale_version_and_writes_nothing(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    loaded = begin(store, sid)
    t = decide(store, loaded, llm=ScriptedLlm(llm_turn(text="one")))
    stale = loaded.header.model_copy(update={"version": 5})
    res = commit_transition(store, stale, "w1", t)
    assert res.outcome == "stale"
    assert len(store.turns(sid)) == 1 and store.header(sid).version == 1


def test_commit_refuses_when_another_worker_took_the_lease(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    loaded = begin(store, sid, "worker-a")
    t = decide(store, loaded, llm=ScriptedLlm(llm_turn(text="one")))
    store.client.delete(store.keys.lease(sid))  # worker-a's lease lapsed ...
    begin(store, sid, "worker-b")  # ... and worker-b took over
    assert commit(store, sid, loaded, t, owner="worker-a").outcome == "lost_lease"
    assert store.header(sid).version == 1 and store.lease_holder(sid) == "worker-b"
    assert store.client.pttl(store.keys.lease(sid)) > 0, "worker-b's lease still lapses if worker-b dies"
    assert commit(store, sid, loaded, t, owner="worker-b").outcome == "ok", "worker-b's own commit goes through"


def _commit_call(store: Store, sid: str, loaded: Any, t: Any, attempt: str, owner: str = "w1") -> list[Any]:
    """One call of commit_step as the client sends it (again, when it retries after a lost reply)."""
    args = commit_record(loaded.header, owner, t, request="test").to_args(attempt, 30_000)
    return list(store._run("commit_step", sid, args, request_id=attempt))


@pytest.mark.parametrize("drive", ["manual", "auto"])
def test_a_commit_retried_after_its_reply_was_lost_gets_the_first_reply(any_store: Store, drive: str) -> None:
    store = any_store
    sid = start(store, drive=drive)
    loaded = begin(store, sid)
    t = decide(store, loaded, llm=ScriptedLlm(llm_turn(("c1", "sync_a", "{}"))))
    first = _commit_call(store, sid, loaded, t, "attempt-1")
    owed = 1 if drive == "auto" else 0
    assert first == ["ok", 2, owed]
    assert _commit_call(store, sid, loaded, t, "attempt-1") == first, "the retry is told what its call did"
    assert _commit_call(store, sid, loaded, t, "attempt-2") == ["stale", "2"], "another commit at that version is not"
    assert len(store.turns(sid)) == 2 and store.header(sid).version == 2, "written once"
    assert event_types(store, sid).count("step_committed") == 1
    assert not store.client.exists(store.keys.request(sid, "attempt-1")), "the header holds the reply"


def test_a_commit_retried_after_the_session_was_cancelled_still_gets_its_reply(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    loaded = begin(store, sid)
    t = decide(store, loaded, llm=ScriptedLlm(llm_turn(("c1", "sync_a", "{}"))))
    assert _commit_call(store, sid, loaded, t, "attempt-1") == ["ok", 2, 0]
    store.cancel(sid)  # between the commit and its retry: the version moved on
    assert _commit_call(store, sid, loaded, t, "attempt-1") == ["ok", 2, 0]


def test_a_refused_commit_retried_is_refused_again(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    loaded = begin(store, sid, "worker-a")
    t = decide(store, loaded, llm=ScriptedLlm(llm_turn(text="one")))
    store.client.set(store.keys.lease(sid), "worker-b", px=30_000)
    assert _commit_call(store, sid, loaded, t, "attempt-1", "worker-a") == ["lost_lease", "worker-b"]
    assert _commit_call(store, sid, loaded, t, "attempt-1", "worker-a") == ["lost_lease", "worker-b"]
    assert not store.client.exists(store.keys.request(sid, "attempt-1")), "a commit keeps no request key"


def test_commit_refuses_a_cancelled_session(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    loaded = begin(store, sid)
    t = decide(store, loaded, llm=ScriptedLlm(llm_turn(text="one")))
    store.cancel(sid)
    loaded.header = loaded.header.model_copy(update={"version": store.header(sid).version})
    assert commit(store, sid, loaded, t).outcome == "ended"
    assert len(store.turns(sid)) == 1


def test_a_failing_model_commits_the_error_and_resuming_clears_it(any_store: Store) -> None:
    from celery_agents.scheduler import LlmFailure

    store = any_store
    sid = start(store)
    step(store, sid, llm=ScriptedLlm(LlmFailure("auth", "bad key", transient=False)))
    h = store.header(sid)
    assert (h.status, h.state) == (Status.FAILED, State.FAILED)
    assert h.error is not None and (h.error.code, h.error.message) == ("auth", "bad key")
    store.prepare_step(sid)
    h = store.header(sid)
    assert (h.status, h.state, h.error) == (Status.ACTIVE, State.READY, None)


# -- end_step and fail_step ----------------------------------------------------------------------


def test_end_step_releases_only_its_own_lease(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    begin(store, sid, "worker-a")
    store.end_step(sid, "worker-b", "r", "wait")
    assert store.lease_holder(sid) == "worker-a"
    store.end_step(sid, "worker-a", "r", "wait")
    assert store.lease_holder(sid) is None
    assert event_types(store, sid)[-1] == "step_noop"
    assert store.header(sid).version == 1


def test_end_step_of_a_waiting_session_drops_the_owed_step(any_store: Store) -> None:
    store = any_store
    sid = start(store, drive="auto", owe=True)
    step(store, sid, llm=ScriptedLlm(llm_turn(("c1", "defer_t", "{}"))))
    step(store, sid)
    store.client.zadd(store.keys.owed, {sid: 1})  # e.g. a resume raced the tools step
    waited = step(store, sid)
    assert waited.transition.kind == "wait" and waited.result is None
    assert store.owed(older_than=9e9) == []


def test_end_step_keeps_a_step_owed_when_asked(any_store: Store) -> None:
    store = any_store
    sid = start(store, drive="auto", owe=True)
    begin(store, sid)
    store.end_step(sid, "w1", "r", "error", keep_owed=True)
    assert store.owed(older_than=9e9) == [sid]


def test_fail_step_fails_the_session_and_fences_queued_copies(any_store: Store) -> None:
    store = any_store
    sid = start(store, drive="auto", owe=True)
    begin(store, sid, "w1")
    assert store.fail_step(sid, 1, ErrorInfo(code="internal_error", message="boom"), "w1")
    h = store.header(sid)
    assert (h.status, h.state, h.version) == (Status.FAILED, State.FAILED, 2)
    assert h.error is not None and h.error.message == "boom"
    assert store.lease_holder(sid) is None
    assert store.owed(older_than=9e9) == []
    assert event_types(store, sid)[-1] == "failed"
    assert not store.fail_step(sid, 1, ErrorInfo(code="x", message="again"), "w1"), "a stale failure is ignored"


# -- journal_put ---------------------------------------------------------------------------------


def test_journal_first_writer_wins(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    assert store.journal_put(sid, "llm:1", "first", "worker-a", 1) == "first"
    assert store.journal_put(sid, "llm:1", "second", "worker-a", 1) == "first"
    assert store.client.hget(store.keys.journal(sid), "llm:1") == "first"
    assert store.journal_put(sid, "tool:1:0", "other field", "worker-a", 1) == "other field"
    assert 0 < store.client.ttl(store.keys.journal(sid)) <= JOURNAL_TTL_S, "a journal expires"


def test_a_step_that_lost_its_lease_or_version_journals_nothing(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    begin(store, sid, "worker-b")
    with pytest.raises(LeaseLost):
        store.journal_put(sid, "tool:1:0", "from a frozen worker", "worker-a", 1)
    with pytest.raises(LeaseLost):
        store.journal_put(sid, "tool:1:0", "from an old step", "worker-b", 0)
    assert not store.client.exists(store.keys.journal(sid))


def test_a_sync_tool_failure_is_committed_as_a_failed_call(any_store: Store) -> None:
    from celery_agents.model import CallOutcome

    store = any_store
    sid = start(store)
    step(store, sid, llm=ScriptedLlm(llm_turn(("c1", "sync_a", "{}"))))
    step(store, sid, tools=RecordingTools({"sync_a": CallOutcome(state="failed", error="exit 3")}))
    [call] = store.calls(sid)
    assert (call.state, call.error) == (CallState.FAILED, "exit 3")
    answer = store.turns(sid)[-1]
    assert isinstance(answer, UserTurn) and answer.tool_responses[0].is_error


# -- load_session and lease_renew ----------------------------------------------------------------


def test_load_reads_a_session_without_taking_the_lease(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    step(store, sid, llm=ScriptedLlm(llm_turn(("c1", "defer_t", "{}"))))
    step(store, sid)
    events_before = len(store.read_events(sid))
    loaded = Store(store.client, store.settings).load(sid)
    assert loaded.header.version == 3 and loaded.header.head == "PartialUserTurn"
    assert [t.kind for t in loaded.turns] == ["UserTurn", "LlmTurn"]
    assert [(c.call_id, c.state) for c in loaded.calls] == [("c1", CallState.DEFERRED)]
    assert store.lease_holder(sid) is None
    assert len(store.read_events(sid)) == events_before


def test_load_of_an_unknown_session(any_store: Store) -> None:
    from celery_agents.errors import UnknownSession

    with pytest.raises(UnknownSession):
        any_store.load("nosuchsession")


def test_only_the_holder_renews_a_lease(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    begin(store, sid, "worker-a")
    key = store.keys.lease(sid)
    lease_ms = int(store.settings.lease_seconds * 1000)
    store.client.pexpire(key, 500)
    assert store.renew_leases([LeaseRef(key, "worker-b", store.keys.meta(sid), 1)]) == ["lost"]
    assert 0 < store.client.pttl(key) <= 500
    assert store.renew_leases([LeaseRef(key, "worker-a", store.keys.meta(sid), 1)]) == ["renewed"]
    assert 500 < store.client.pttl(key) <= lease_ms


def test_a_lapsed_step_lease_is_taken_again_only_while_the_session_waits_at_the_step(any_store: Store) -> None:
    """A lease that lapsed under its holder (Redis away longer than the lease, or restarted) with
    nobody else taking it comes back to that holder; not once the session moved past its step."""
    store = any_store
    sid = start(store)
    loaded = begin(store, sid, "worker-a")
    key = store.keys.lease(sid)
    mine = LeaseRef(key, "worker-a", store.keys.meta(sid), 1)
    store.client.delete(key)
    assert store.renew_leases([mine]) == ["retaken"]
    assert store.lease_holder(sid) == "worker-a"
    assert 0 < store.client.pttl(key) <= int(store.settings.lease_seconds * 1000)
    t = decide(store, loaded, ScriptedLlm(llm_turn(text="done")))
    assert commit(store, sid, loaded, t, owner="worker-a").outcome == "ok"
    assert store.renew_leases([mine]) == ["lost"]
    assert store.lease_holder(sid) is None, "a lease of a step already committed is not brought back"


def test_a_lapsed_step_lease_of_a_cancelled_session_is_not_taken_again(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    begin(store, sid, "worker-a")
    store.cancel(sid)
    store.client.delete(store.keys.lease(sid))
    assert store.renew_leases([LeaseRef(store.keys.lease(sid), "worker-a", store.keys.meta(sid), 1)]) == ["lost"]
    assert store.lease_holder(sid) is None


def test_a_step_lease_lapses_on_its_own(any_store: Store) -> None:
    store = any_store
    sid = start(store)
    begin(store, sid, "worker-a")
    ttl = store.client.pttl(store.keys.lease(sid))
    assert 0 < ttl <= int(store.settings.lease_seconds * 1000)


def test_owed_lists_only_steps_owed_longer_than_the_grace(any_store: Store) -> None:
    store = any_store
    t0 = 1_700_000_000.0
    old = store.create_session(AGENT, UserQuery(text="a"), drive="auto", owe=True, now=t0).session_id
    new = store.create_session(AGENT, UserQuery(text="b"), drive="auto", owe=True, now=t0 + 60).session_id
    assert store.owed(older_than=t0 + 30) == [old]
    assert sorted(store.owed(older_than=t0 + 90)) == sorted([old, new])
