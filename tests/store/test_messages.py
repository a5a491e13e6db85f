"""Follow-up messages (`session send`) through the real scripts: a completed session continues, a
waiting one gets the message after its tool results, several keep their order, a cancelled one
refuses, and a message sent while a step commits is delivered exactly once."""

from __future__ import annotations

from typing import Any

import pytest

from celery_agents.errors import SessionNotAdvanceable
from celery_agents.model import LlmTurn, State, Status, UserQuery, UserTurn
from celery_agents.store import Store, completion_json
from tests.scheduler.fakes import ScriptedLlm, llm_turn
from tests.store.scenario import begin, commit, decide, start, step, token_of, waiting_on
from tests.store.test_races import race

ROUNDS = 10


def _texts(store: Store, sid: str) -> list[str]:
    """The transcript as the model sees it, one line per turn."""
    out = []
    for t in store.turns(sid):
        if isinstance(t, LlmTurn):
            out.append(f"llm:{t.text or ','.join(c.name for c in t.tool_calls)}")
        else:
            if t.tool_responses:
                out.append("results:" + ",".join(r.call_id for r in t.tool_responses))
            if t.query is not None:
                out.append(f"user:{t.query.text}")
    return out


def test_a_message_continues_a_completed_session_which_answers_it(store: Store) -> None:
    sid = start(store, text="first")
    step(store, sid, llm=ScriptedLlm(llm_turn(text="answer one")))
    assert store.header(sid).status == Status.COMPLETED

    store.send_message(sid, UserQuery(text="and then?"))
    h = store.header(sid)
    assert (h.status, h.state, h.response) == (Status.ACTIVE, State.READY, None)

    llm = ScriptedLlm(llm_turn(text="answer two"))
    step(store, sid, llm=llm)
    h = store.header(sid)
    assert (h.status, h.response) == (Status.COMPLETED, "answer two")
    assert _texts(store, sid) == ["user:first", "llm:answer one", "user:and then?", "llm:answer two"]
    assert llm.requests[0].messages[-1] == {"role": "user", "content": "and then?"}
    assert store.client.llen(store.keys.inbox(sid)) == 0


def test_messages_sent_while_calls_wait_follow_the_results_in_the_order_sent(store: Store) -> None:
    sid, calls = waiting_on(store, ("c1", "defer_t"))
    store.send_message(sid, UserQuery(text="one"))
    store.send_message(sid, UserQuery(text="two"))
    assert step(store, sid).transition.kind == "wait", "the messages wait for the unfinished call"

    store.complete_token(token_of(calls, "c1"), completion_json("done", is_error=False, by=None, now=0))
    step(store, sid, llm=ScriptedLlm(llm_turn(text="thanks")))
    assert _texts(store, sid)[-4:] == ["results:c1", "user:one", "user:two", "llm:thanks"]
    assert store.header(sid).status == Status.COMPLETED


def test_a_cancelled_session_refuses_a_message(store: Store) -> None:
    sid = start(store)
    store.cancel(sid)
    with pytest.raises(SessionNotAdvanceable) as caught:
        store.send_message(sid, UserQuery(text="hello?"))
    assert caught.value.code == "session_not_advanceable" and caught.value.exit_code == 5


def test_a_message_sent_while_the_step_that_completes_runs_is_answered_next(store: Store) -> None:
    sid = start(store, drive="auto")
    loaded = begin(store, sid)
    t = decide(store, loaded, llm=ScriptedLlm(llm_turn(text="done")))
    store.send_message(sid, UserQuery(text="late"))  # after the step read the queue
    res = commit(store, sid, loaded, t)
    assert (res.outcome, res.owed) == ("ok", True), "the session is owed another step, not completed"
    h = store.header(sid)
    assert (h.status, h.state) == (Status.ACTIVE, State.READY)
    step(store, sid, llm=ScriptedLlm(llm_turn(text="late answer")))
    assert _texts(store, sid)[-2:] == ["user:late", "llm:late answer"]


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_a_message_racing_the_commit_is_delivered_exactly_once(store: Store, stores: Any, round_: int) -> None:
    sid = start(store)
    store.send_message(sid, UserQuery(text="early"))
    a, b = stores(), stores()
    loaded = begin(a, sid, "worker-a")
    t = decide(a, loaded, llm=ScriptedLlm(llm_turn(text="done")))
    ra, rb = race(lambda: commit(a, sid, loaded, t, "worker-a"), lambda: b.send_message(sid, UserQuery(text="racer")))
    assert ra.outcome == "ok" and not isinstance(rb, Exception), (ra, rb)
    delivered = [x for x in _texts(store, sid) if x.startswith("user:")]
    waiting = [UserQuery.model_validate_json(m).text for m in store.client.lrange(store.keys.inbox(sid), 0, -1)]
    assert delivered == ["user:What is the weather in Paris?", "user:early"]
    assert waiting == ["racer"], "the racer was not read by the step: it waits, once"
    h = store.header(sid)
    assert (h.status, h.state) == (Status.ACTIVE, State.READY), "and the session does not end with it unread"
    step(store, sid, llm=ScriptedLlm(llm_turn(text="ok")))
    assert [x for x in _texts(store, sid) if x.startswith("user:")][-1] == "user:racer"
    assert store.client.llen(store.keys.inbox(sid)) == 0


def test_a_message_becomes_a_user_turn_of_its_own_after_the_tool_results(store: Store) -> None:
    sid, _ = waiting_on(store, ("s1", "sync_a"))
    store.send_message(sid, UserQuery(text="also this"))
    step(store, sid, llm=ScriptedLlm(llm_turn(text="fine")))
    turns = store.turns(sid)
    assert isinstance(turns[-3], UserTurn) and turns[-3].tool_responses and turns[-3].query is None
    assert isinstance(turns[-2], UserTurn) and turns[-2].query == UserQuery(text="also this")


def _counted(store: Store, sid: str) -> tuple[int, int]:
    """The header's count of queued messages and the inbox's length."""
    return store.header(sid).inbox_waiting, int(store.client.llen(store.keys.inbox(sid)))


def test_the_header_counts_the_queued_messages_exactly(store: Store) -> None:
    sid, calls = waiting_on(store, ("c1", "defer_t"))
    assert _counted(store, sid) == (0, 0)
    store.send_message(sid, UserQuery(text="one"))
    store.send_message(sid, UserQuery(text="two"))
    assert _counted(store, sid) == (2, 2)
    assert step(store, sid).transition.kind == "wait"
    store.complete_token(token_of(calls, "c1"), completion_json("done", is_error=False, by=None, now=0))
    loaded = begin(store, sid)
    t = decide(store, loaded, llm=ScriptedLlm(llm_turn(text="thanks")))
    store.send_message(sid, UserQuery(text="three"))  # after the step read the queue
    assert commit(store, sid, loaded, t).outcome == "ok"
    assert _counted(store, sid) == (1, 1), "the commit took two, one came meanwhile"
    step(store, sid, llm=ScriptedLlm(llm_turn(text="and three")))
    assert _counted(store, sid) == (0, 0)
    assert store.header(sid).status == Status.COMPLETED
    store.send_message(sid, UserQuery(text="four"))
    assert _counted(store, sid) == (1, 1)
    store.cancel(sid)
    assert _counted(store, sid) == (0, 0)


def test_a_count_left_too_high_never_keeps_a_session_from_completing(store: Store) -> None:
    """A header counting messages the inbox no longer holds: the next commit reads the list."""
    sid = start(store)
    store.client.hset(store.keys.meta(sid), "inbox_waiting", "2")
    step(store, sid, llm=ScriptedLlm(llm_turn(text="done")))
    assert store.header(sid).status == Status.COMPLETED
    assert _counted(store, sid) == (0, 0)
