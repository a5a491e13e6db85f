"""SIGKILL the whole worker while it holds 150 steps waiting on the model at once (one steps process,
threads pool); a fresh worker finishes every session, nothing is lost or done twice, and every
invariant holds. And one steps process keeps more model calls in flight to one host than litellm's
connection pool allows by default, when its threads ask for that many."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from celery_agents.config import Settings
from celery_agents.model import UserQuery
from celery_agents.store import Store
from celery_agents.tasks.config import Dispatcher, make_app
from celery_agents.tools.resolve import parse_agent
from tests.chaos.conftest import Fleet, report
from tests.chaos.invariants import check_invariants
from tests.e2e.conftest import record_tool, runs, wait_for
from tests.support.llm_server import HeldModel as HeldCalls
from tests.support.llm_server import LlmServer, Reply, calls, text

pytestmark = pytest.mark.slow

SESSIONS = 150


class HeldModel:
    """Holds every first model call until the worker is killed; answers at once afterwards."""

    def __init__(self) -> None:
        self.killed = threading.Event()
        self.lock = threading.Lock()
        self.holding = 0

    def __call__(self, body: dict[str, Any]) -> Reply:
        if body["messages"][-1]["role"] == "tool":
            return text("done")
        with self.lock:
            self.holding += 1
        self.killed.wait(120)
        with self.lock:
            self.holding -= 1
        return calls(("sync_tool", {"x": 1}))


def test_sigkill_with_150_steps_waiting_on_the_model(
    fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer, tmp_path: Path
) -> None:
    model = HeldModel()
    scenario = llm_server.scenario([model])
    log = tmp_path / "runs.jsonl"
    agent = parse_agent(
        {
            "slug": "in-flight",
            "model": f"openai/{scenario}",
            "apiBase": llm_server.url,
            "tools": [record_tool("sync_tool", log)],
        }
    )
    doomed = fleet.start()
    store = Store(fleet.client, chaos_settings)
    app = make_app(chaos_settings, main="chaos_in_flight")
    try:
        sids = [
            store.create_session(agent, UserQuery(text="go"), drive="auto", owe=True).session_id
            for _ in range(SESSIONS)
        ]
        for sid in sids:
            Dispatcher(app).step(sid, 1)
        # One worker, one steps process: all 150 steps are in its threads, waiting on the model.
        deadline = time.monotonic() + 120
        while model.holding < SESSIONS:
            assert time.monotonic() < deadline, (
                f"{model.holding} model calls in flight at once, not {SESSIONS}; {llm_server.count(scenario)} requests"
            )
            time.sleep(0.05)
        killed_at = time.monotonic()
        doomed.kill()
        model.killed.set()
        fleet.start()
        wait_for(
            lambda: all(store.header(s).status.value != "active" for s in sids),
            timeout=180,
            what="a fresh worker to finish every session",
        )
        recovery = time.monotonic() - killed_at
        for sid in sids:
            check_invariants(store, sid)
            assert store.header(sid).response == "done"
    finally:
        app.close()
    # The killed steps had journaled nothing: each session asked the model once more, then once
    # after its tool; the tool ran exactly once per session (it only ran after the kill). One run
    # on a crowded machine counted 451 requests, cause not established (a request the adapter
    # retries after a failure in transit counts twice): a few extra are tolerated, a model call
    # repeated per session would add 150.
    assert 3 * SESSIONS <= llm_server.count(scenario) <= 3 * SESSIONS + 5
    rows = runs(log, "sync_tool", phase="start")
    assert len(rows) == SESSIONS and len({r["key"] for r in rows}) == SESSIONS
    report("sigkill_150_in_flight", recovery_s=round(recovery, 2), model_requests=llm_server.count(scenario))


#: above litellm's default of 500 connections to one host (its aiohttp connector's limit per host)
BEYOND_POOL = 540


def test_one_steps_process_keeps_more_calls_in_flight_than_litellms_default_pool(
    fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer
) -> None:
    """`--step-threads 560`: the supervisor raises litellm's connection limits before its zygote
    imports litellm, so 540 steps of one process all reach the model at once, not 500 of them
    with the rest queued for a connection."""
    model = HeldCalls()
    scenario = llm_server.scenario([model])
    agent = parse_agent({"slug": "pool", "model": f"openai/{scenario}", "apiBase": llm_server.url})
    # Exec'd, not forked from the test launcher: that process imported litellm already, and litellm
    # reads its limits once, when imported (tests/support/launcher.py).
    fleet.start(queues="steps", step_threads=BEYOND_POOL + 20, fork=False)
    store = Store(fleet.client, chaos_settings)
    app = make_app(chaos_settings, main="chaos_pool")
    try:
        sids = [store.create_session(agent, UserQuery(text="go")).session_id for _ in range(BEYOND_POOL)]
        for sid in sids:
            Dispatcher(app).step(sid, 1)
        deadline = time.monotonic() + 120
        most = 0
        while model.holding < BEYOND_POOL:
            most = max(most, model.holding)
            assert time.monotonic() < deadline, (
                f"at most {most} model calls in flight at once, not {BEYOND_POOL}; "
                f"{llm_server.count(scenario)} requests reached the model"
            )
            time.sleep(0.05)
        model.released.set()
        wait_for(
            lambda: all(store.header(s).status.value == "completed" for s in sids),
            timeout=120,
            what="every session to complete",
        )
        assert llm_server.count(scenario) == BEYOND_POOL
    finally:
        model.released.set()
        app.close()
