"""The one checker every chaos test runs on every session it touched."""

from __future__ import annotations

from celery_agents.model import LlmTurn, UserTurn
from celery_agents.store import Store


def check_invariants(store: Store, sid: str, *, completed: bool = True) -> None:
    """Turn order, one answer per call id in call order, versions strictly increasing, no owed step,
    no orphaned token, nothing left pending, dispatched or journaled."""
    h = store.header(sid)
    turns = store.turns(sid)
    assert turns and isinstance(turns[0], UserTurn) and turns[0].query is not None, "starts with the user's query"
    for i, turn in enumerate(turns[1:], start=1):
        prev = turns[i - 1]
        if isinstance(turn, UserTurn) and isinstance(prev, UserTurn):
            # Only a message sent meanwhile (`session send`) follows a user turn: a query, no answers.
            assert turn.query is not None and not turn.tool_responses, f"turn {i} repeats UserTurn"
            continue
        assert type(turn) is not type(prev), f"turn {i} repeats {type(turn).__name__}"
        if isinstance(turn, UserTurn) and turn.tool_responses:
            assert isinstance(prev, LlmTurn) and prev.tool_calls, f"turn {i}: tool answers without calls"
            assert [r.call_id for r in turn.tool_responses] == [c.id for c in prev.tool_calls], (
                f"turn {i}: answers {[r.call_id for r in turn.tool_responses]} do not match the calls "
                f"{[c.id for c in prev.tool_calls]} one for one, in order"
            )
    assert h.turn_count == len(turns)
    commits = [e for e in store.read_events(sid) if e["type"] == "step_committed"]
    froms = [e["from_version"] for e in commits]
    assert froms == sorted(set(froms)), f"a version was committed twice: {froms}"
    assert [e["version"] for e in commits] == [f + 1 for f in froms], "each commit bumps the version by one"
    if commits:
        assert h.version >= commits[-1]["version"]
    calls = store.calls(sid)
    assert len({c.field for c in calls}) == len(calls)
    r = store.client
    k = store.keys.for_session(sid)  # the session's index shard (all of it on one Redis)
    if completed:
        assert h.status.value == "completed", f"session {sid} ended {h.status.value}: {h.error}"
        assert isinstance(turns[-1], LlmTurn) and not turns[-1].tool_calls
        assert all(c.state.final for c in calls), "every call has a final outcome"
        assert r.zscore(k.owed, sid) is None, "no step is owed"
        assert r.hlen(k.pending(sid)) == 0
        assert not r.exists(k.journal(sid)), "no journal left behind"
        assert not r.exists(k.lease(sid))
        assert r.llen(k.inbox(sid)) == 0, "no message sent to it is left undelivered"
        for member in r.zrange(k.dispatched, 0, -1) + r.zrange(k.pending_all, 0, -1) + r.zrange(k.deadlines, 0, -1):
            assert not member.startswith(sid + " "), f"index entry left behind: {member}"
        for key in r.scan_iter(match=k.session(sid, "tok:*")):
            assert r.hget(key, "state") != "pending", f"orphaned token {key}"


def check_tree(store: Store, root: str) -> list[str]:
    """`check_invariants` on a session and every session below it, and their links: each child
    names its parent and the parent's call that started it, that call names the child (an id derived
    from the call: one child per call, however often it was started), a child's end is its call's
    outcome, and the parent lists exactly the children its calls started. Returns the tree's ids."""
    tree = [root]
    for sid in tree:
        check_invariants(store, sid)
        calls = {c.field: c for c in store.calls(sid)}
        started = sorted(str(c.meta.child) for c in calls.values() if c.meta.child)
        children = store.children(sid)
        assert children == started, f"{sid} lists children {children}; its calls started {started}"
        for child in children:
            h = store.header(child)
            assert (h.parent, h.parent_call) == (sid, next(f for f, c in calls.items() if c.meta.child == child))
            call = calls[h.parent_call or ""]
            assert call.result == h.response, f"call {call.call_id} got {call.result!r}, its child said {h.response!r}"
        tree += children
    return tree
