"""Races the scripts must settle: two commits of one version, two completions of one token, two
results of one call, a result racing a cancel. Threads start together at a barrier."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from celery_agents.errors import TokenAlreadyCompleted
from celery_agents.model import CallState, LlmTurn, State, Status
from celery_agents.store import Store, completion_json, outcome_json
from tests.scheduler.fakes import ScriptedLlm, llm_turn
from tests.store.scenario import begin, commit, decide, start, token_hash, token_of, waiting_on

ROUNDS = 10


def race(*work: Callable[[], Any]) -> list[Any]:
    """Run each callable in its own thread, released together; returns results or exceptions."""
    barrier = threading.Barrier(len(work))
    results: list[Any] = [None] * len(work)

    def run(i: int, fn: Callable[[], Any]) -> None:
        barrier.wait()
        try:
            results[i] = fn()
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(work)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_two_commits_for_the_same_version_exactly_one_wins(store: Store, stores: Any, round_: int) -> None:
    sid = start(store)
    a, b = stores(), stores()
    la = begin(a, sid, "worker-a")
    ta = decide(a, la, llm=ScriptedLlm(llm_turn(text="from a")))
    a.client.delete(a.keys.lease(sid))  # a's lease lapsed, b picked the step up too
    lb = begin(b, sid, "worker-b")
    tb = decide(b, lb, llm=ScriptedLlm(llm_turn(text="from b")))
    b.client.delete(b.keys.lease(sid))  # and b's lapsed as well: only the version fences them
    ra, rb = race(lambda: commit(a, sid, la, ta, "worker-a"), lambda: commit(b, sid, lb, tb, "worker-b"))
    outcomes = sorted([ra.outcome, rb.outcome])
    assert outcomes == ["ok", "stale"], (ra, rb)
    turns = store.turns(sid)
    assert len(turns) == 2
    winner = "from a" if ra.outcome == "ok" else "from b"
    assert isinstance(turns[1], LlmTurn) and turns[1].text == winner
    h = store.header(sid)
    assert (h.version, h.steps, h.response) == (2, 1, winner)
    assert h.usage.total_tokens == 12, "the loser's usage is not counted"
    committed = [e for e in store.read_events(sid) if e["type"] == "step_committed"]
    assert len(committed) == 1


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_two_workers_beginning_the_same_step_one_gets_the_lease(store: Store, stores: Any, round_: int) -> None:
    sid = start(store)
    a, b = stores(), stores()
    ra, rb = race(lambda: a.begin_step(sid, 1, "worker-a"), lambda: b.begin_step(sid, 1, "worker-b"))
    assert sorted([ra.outcome, rb.outcome]) == ["busy", "ok"]
    winner = "worker-a" if ra.outcome == "ok" else "worker-b"
    assert store.lease_holder(sid) == winner


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_two_completions_of_one_token_one_wins_the_other_learns_why(store: Store, stores: Any, round_: int) -> None:
    sid, calls = waiting_on(store, ("c1", "defer_t"), drive="auto")
    token = token_of(calls, "c1")
    a, b = stores(), stores()

    def complete(s: Store, who: str) -> Any:
        return s.complete_token(token, completion_json(who, is_error=False, by=who, now=time.time()), by=who)

    ra, rb = race(lambda: complete(a, "alice"), lambda: complete(b, "bob"))
    won = [r for r in (ra, rb) if not isinstance(r, Exception)]
    lost = [r for r in (ra, rb) if isinstance(r, Exception)]
    assert len(won) == 1 and len(lost) == 1, (ra, rb)
    assert isinstance(lost[0], TokenAlreadyCompleted)
    outcome, _ = won[0]
    assert outcome.woken and outcome.remaining == 0
    winner = "alice" if ra is won[0] else "bob"
    [call] = store.calls(sid)
    assert (call.state, call.result, call.completed_by) == (CallState.COMPLETED, winner, winner)
    assert token_hash(store, token)["completed_by"] == winner
    assert store.owed(older_than=9e9).count(sid) == 1
    store.client.zrem(store.keys.owed, sid)


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_two_results_of_one_call_one_is_recorded(store: Store, stores: Any, round_: int) -> None:
    sid, calls = waiting_on(store, ("c1", "async_t"), drive="auto")
    field = calls[0].field
    a, b = stores(), stores()

    def record(s: Store, value: str) -> Any:
        return s.record_result(sid, field, outcome_json(CallState.COMPLETED, result=value, now=time.time()), {})

    ra, rb = race(lambda: record(a, "a"), lambda: record(b, "b"))
    assert sorted([ra.status, rb.status]) == ["already", "ok"]
    assert [r.woken for r in (ra, rb)].count(True) == 1
    winner = "a" if ra.status == "ok" else "b"
    assert store.calls(sid)[0].result == winner


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_an_async_result_racing_a_cancel_changes_nothing_after_it(store: Store, stores: Any, round_: int) -> None:
    sid, calls = waiting_on(store, ("c1", "async_t"), ("c2", "async_t"), drive="auto")
    first, second = calls[0].field, calls[1].field
    store.record_result(sid, first, outcome_json(CallState.COMPLETED, result=1, now=time.time()), {})
    a, b = stores(), stores()

    def record() -> Any:
        return a.record_result(sid, second, outcome_json(CallState.COMPLETED, result=2, now=time.time()), {})

    res, cancelled_version = race(record, lambda: b.cancel(sid))
    h = store.header(sid)
    assert (h.status, h.state, h.version) == (Status.CANCELLED, State.CANCELLED, cancelled_version)
    assert store.owed(older_than=9e9) == [], "a cancelled session is never owed a step"
    c2 = store.calls(sid)[1]
    if res.status == "ok":  # the result came first: recorded, then cancel found nothing to cancel
        assert c2.state == CallState.COMPLETED
    else:  # the cancel came first: the late result is dropped
        assert res.status == "already" and not res.woken
        assert c2.state == CallState.CANCELLED
    assert store.pending_view(sid) == []
    assert store.begin_step(sid, h.version, "w").outcome == "ended"
