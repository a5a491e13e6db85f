"""The client's waiting logic: when a driven session counts as settled (queue mode)."""

from __future__ import annotations

import time

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.drivers.celery import CeleryDriver, settled
from celery_agents.errors import UnknownToken
from celery_agents.model import CallState, EventType, State, Status
from celery_agents.store import Store, outcome_json
from tests.scheduler.fakes import ScriptedLlm, llm_turn
from tests.store.scenario import start, step, waiting_on


def test_a_session_whose_last_call_finishes_while_it_is_looked_at_is_not_settled(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Client(settings, inline=False) as client:
        store = client.store
        sid, calls = waiting_on(store, ("c1", "async_t"), drive="auto")
        seen_before = store.header(sid)
        assert seen_before.state == State.WAITING
        assert settled(store, sid, None) is False, "an async call runs: the session goes on"
        # The call finishes between the client's two reads (header, then pending calls).
        done = outcome_json(CallState.COMPLETED, result="ok", now=time.time(), attempts=1)
        assert store.record_result(sid, calls[0].field, done, {}).woken
        monkeypatch.setattr(store, "header", lambda _sid: seen_before)
        assert settled(store, sid, None) is False, "a step is owed: `run` must not return `ready`"
        monkeypatch.undo()
        assert settled(store, sid, None) is False, "ready in auto drive: the owed step comes next"


def test_a_drive_that_settles_ahead_of_the_events_read_still_hands_every_event(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session completes while the client handles a tool's event: the header it reads then is
    ahead of the events it has read. `run` must still show the session's last events."""
    sid = start(store, drive="auto")
    step(store, sid, llm=ScriptedLlm(llm_turn(("c1", "sync_a", "{}"))))
    before = store.header(sid)  # the tools step is owed: not settled
    step(store, sid)  # runs the tool: tool_finished
    step(store, sid, llm=ScriptedLlm(llm_turn(text="the answer")))  # completed
    assert store.header(sid).status == Status.COMPLETED
    real_header, real_read = store.header, store.read_events
    headers = iter([before])
    monkeypatch.setattr(store, "header", lambda s: next(headers, None) or real_header(s))
    reads = iter([True])

    def read_events(s: str, after: str, **kw: object) -> list[dict[str, object]]:
        events = real_read(s, after)
        if next(reads, False):  # the first read: the stream as it stood when the tool finished
            ends = [i for i, e in enumerate(events) if e["type"] == EventType.TOOL_FINISHED]
            return events[: ends[0] + 1]
        return events

    monkeypatch.setattr(store, "read_events", read_events)
    seen: list[str] = []
    CeleryDriver(store, publisher=None).drive(  # type: ignore[arg-type]
        sid, before.version, after="0-0", publish=False, wait=True, timeout=5, on_event=lambda e: seen.append(e["type"])
    )
    assert EventType.TOOL_FINISHED in seen
    assert seen[-2:] == [EventType.COMPLETED, EventType.STEP_COMMITTED], seen


def test_every_decision_on_a_token_says_when_it_was_given_a_session_id(settings: Settings) -> None:
    """The hint comes from the Client, so the CLI, the HTTP API, the MCP server and programs
    all give it: a session id is not a token, and `pending` lists the session's tokens."""
    sid = "0123456789abcdef0123456789abcdef"
    with Client(settings, inline=True) as client:
        for decide in (
            lambda: client.complete(sid, "x"),
            lambda: client.approve(sid),
            lambda: client.reject(sid),
            lambda: client.extend(sid, 5),
        ):
            with pytest.raises(UnknownToken, match=r"is not a token .* `agents session pending"):
                decide()
