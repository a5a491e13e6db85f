"""A completions stream entry applied by a consumer that stalled before acknowledging it (its ack
lost, or the process frozen) is taken over by the next consumer: it is applied once and is not
also listed as rejected."""

from __future__ import annotations

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.errors import RedisUnavailable
from celery_agents.runtime.completions import CompletionConsumer
from tests.scheduler.fakes import RecordingTools, ScriptedLlm, llm_turn, make_agent


def test_an_entry_applied_but_not_acknowledged_is_not_rejected_by_the_consumer_that_takes_over(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = ScriptedLlm(llm_turn(("c1", "defer_t", "{}")), llm_turn(text="approved"))
    with Client(settings, inline=True, llm=llm, tools=RecordingTools()) as client:
        store = client.store
        sid = client.start(make_agent(), "pay", run=True).session_id
        (pending,) = client.pending(sid)
        store.client.xadd(store.keys.completions, {"token": pending.token or "", "result": '"yes"', "by": "erp"})
        stalled = CompletionConsumer(store.at_once(), "stalled")

        def ack_lost(entry_id: str) -> None:
            raise RedisUnavailable("the acknowledgement never arrived")

        monkeypatch.setattr(stalled.stream, "ack", ack_lost)
        with pytest.raises(RedisUnavailable):
            stalled.poll(block_ms=None)
        assert client.view(sid).pending == [], "the first consumer applied it"
        assert store.client.xpending(store.keys.completions, "celery-agents")["pending"] == 1

        CompletionConsumer(store, "next").poll(block_ms=None)

        assert store.client.xpending(store.keys.completions, "celery-agents")["pending"] == 0
        assert store.client.xlen(store.keys.rejected) == 0, store.client.xrange(store.keys.rejected)
        events = [e["type"] for e in store.read_events(sid)]
        assert events.count("token_completed") == 1 and "token_rejected" not in events
