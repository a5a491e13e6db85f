"""The client's waiting logic: when a driven session counts as settled (queue mode)."""

from __future__ import annotations

import time

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.drivers.celery import settled
from celery_agents.model import CallState, State
from celery_agents.store import outcome_json
from tests.store.scenario import waiting_on


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
