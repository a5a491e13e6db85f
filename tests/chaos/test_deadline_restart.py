"""Deadlines live in Redis, not in a worker: a deadline that passes while no worker runs is honoured
by the next worker that starts."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.errors import TokenExpired
from tests.chaos.conftest import Fleet
from tests.chaos.invariants import check_invariants
from tests.e2e.conftest import wait_for
from tests.support.llm_server import LlmServer, Reply, calls, text

pytestmark = pytest.mark.slow


def ask_then_answer(body: dict[str, Any]) -> Reply:
    if body["messages"][-1]["role"] == "tool":
        return text("noted: " + body["messages"][-1]["content"][:40])
    return calls(("ask", {"n": 1}))


def test_a_deadline_passing_between_workers_is_not_lost(
    fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    scenario = llm_server.scenario([ask_then_answer])
    path = write_agent(
        {
            "slug": "deadline",
            "model": f"openai/{scenario}",
            "apiBase": llm_server.url,
            "tools": [{"name": "ask", "external": True}],
            "toolCallPolicy": {
                "rules": [
                    {
                        "tool": "ask",
                        "disposition": {"tag": "defer", "reason": "a person answers", "timeoutSeconds": 1.5},
                    }
                ]
            },
        }
    )
    first = fleet.start()
    with Client(chaos_settings, inline=False) as client:
        store = client.store
        view = client.start(path, "ask someone", run=True, timeout=30)
        (pending,) = view.pending
        first.kill()  # no worker runs while the deadline passes
        wait_for(lambda: time.time() > (pending.expires_at or 0) + 0.2, what="the deadline to pass")
        (call,) = store.pending_calls(view.session_id)
        assert call.state.value == "deferred", "nothing expires it while no worker runs"
        fleet.start()
        wait_for(
            lambda: store.header(view.session_id).status.value == "completed",
            timeout=60,
            what="the new worker to expire the call and finish the session",
        )
        check_invariants(store, view.session_id)
        with pytest.raises(TokenExpired):
            client.complete(pending.token or "", "too late")
    answer = llm_server.requests[scenario][-1]["messages"][-1]["content"]
    assert answer.startswith("Error: No result arrived before the deadline")
