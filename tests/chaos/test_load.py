"""Load: 500 sessions of 5 steps each on 2 worker processes, with a model that fails transiently
5% of the time and answers after 0-200 ms. Every session completes and keeps every invariant."""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from tests.chaos.conftest import Fleet, report
from tests.chaos.invariants import check_invariants
from tests.e2e.conftest import wait_for
from tests.support.llm_server import LlmServer, Reply, calls, error, text

pytestmark = pytest.mark.slow

SESSIONS = int(os.environ.get("AGENTS_LOAD_SESSIONS", "500"))


class FlakyModel:
    """Two tool rounds, then an answer; 5% of requests fail with 500 or 429; 0-200 ms delays."""

    def __init__(self, seed: int = 7) -> None:
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.errors = 0
        self.requests = 0

    def __call__(self, body: dict[str, Any]) -> Reply:
        with self.lock:
            self.requests += 1
            delay = self.rng.uniform(0, 0.2)
            fail = self.rng.random() < 0.05
            status = self.rng.choice((500, 429))
            if fail:
                self.errors += 1
        if fail:
            return error(status, "injected transient failure", delay=delay)
        rounds = sum(1 for m in body["messages"] if m["role"] == "tool")
        if rounds < 2:
            return calls(("get_weather", {"city": f"City{rounds}"}), delay=delay)
        return text("weather reported", delay=delay)


def test_five_hundred_sessions_under_transient_failures(
    fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer, write_agent: Any
) -> None:
    model = FlakyModel()
    scenario = llm_server.scenario([model])
    path = write_agent(
        {
            "slug": "load",
            "model": f"openai/{scenario}",
            "apiBase": llm_server.url,
            "tools": [
                {
                    "name": "get_weather",
                    "python": "celery_agents.tools.demo:get_weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                }
            ],
        }
    )
    fleet.start(concurrency=2, AGENTS_LLM_BACKOFF="0.05", AGENTS_LLM_ATTEMPTS="6")
    with Client(chaos_settings, inline=False) as client:
        store = client.store
        started = time.monotonic()
        sids = [client.start(path, f"weather {i}", run=True, wait=False).session_id for i in range(SESSIONS)]
        wait_for(
            lambda: (
                store.client.zcard(store.keys.state_index("completed"))
                + store.client.zcard(store.keys.state_index("failed"))
                >= SESSIONS
            ),
            timeout=600,
            what="every session to finish",
        )
        elapsed = time.monotonic() - started
        failed = store.client.zcard(store.keys.state_index("failed"))
        assert failed == 0, f"{failed} sessions failed"
        for sid in sids:
            check_invariants(store, sid)
            assert store.header(sid).steps == 5
    report(
        "load",
        sessions=SESSIONS,
        seconds=round(elapsed, 1),
        sessions_per_s=round(SESSIONS / elapsed, 2),
        steps_per_s=round(5 * SESSIONS / elapsed, 1),
        model_requests=model.requests,
        injected_errors=model.errors,
    )
