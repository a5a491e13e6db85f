"""SIGTERM is a warm shutdown: the steps in flight finish and commit before the worker exits, and
what the sessions owe next is picked up by another worker."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.model import UserQuery
from celery_agents.store import Store
from celery_agents.tasks.config import Dispatcher, make_app
from celery_agents.tools.resolve import parse_agent
from tests.chaos.conftest import Fleet, report
from tests.chaos.invariants import check_invariants
from tests.chaos.test_kill_worker import agent, conversation
from tests.e2e.conftest import wait_for
from tests.support.llm_server import LlmServer, text
from tests.support.queues import depth

pytestmark = pytest.mark.slow


def test_sigterm_lets_the_running_step_commit(
    fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    scenario = llm_server.scenario([conversation(delay_first=2)])
    path = write_agent(agent(scenario, llm_server.url, tmp_path / "runs.jsonl"))
    first = fleet.start()
    with Client(chaos_settings, inline=False) as client:
        store = client.store
        sid = client.start(path, "go", run=True, wait=False).session_id
        wait_for(lambda: llm_server.count(scenario) == 1, what="the model call to start")
        assert first.terminate() == 0
        commits = [e for e in store.read_events(sid) if e["type"] == "step_committed"]
        assert commits and commits[0]["from_version"] == 1, "the in-flight step committed before the worker exited"
        started = time.monotonic()
        fleet.start()
        wait_for(lambda: store.header(sid).status.value == "completed", timeout=60, what="another worker to finish")
        check_invariants(store, sid)
        report("sigterm", takeover_s=round(time.monotonic() - started, 2))
    assert llm_server.count(scenario) == 2


def test_sigterm_with_steps_in_flight_loses_no_step(
    fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer
) -> None:
    """Step messages are taken without acknowledgement, so nothing in the broker would bring back
    one the stopping worker dropped: the steps it runs finish before it exits, it takes none of
    the steps published while it stops (one thread is free, so a BRPOP is outstanding), and every
    session ends with each model call made once."""
    scenario = llm_server.scenario([text("done", delay=3)])
    spec = parse_agent({"slug": "stopping", "model": f"openai/{scenario}", "apiBase": llm_server.url})
    stopping = fleet.start(step_threads=4)
    store = Store(fleet.client, chaos_settings)
    app = make_app(chaos_settings, main="chaos_shutdown")

    def publish(n: int) -> list[str]:
        sids = [store.create_session(spec, UserQuery(text="go"), drive="auto", owe=True).session_id for _ in range(n)]
        for sid in sids:
            Dispatcher(app).step(sid, 1)
        return sids

    try:
        running = publish(3)
        wait_for(lambda: llm_server.count(scenario) == 3, what="three model calls in flight")
        assert stopping.proc is not None
        stopping.proc.send_signal(signal.SIGTERM)
        late = publish(2)
        assert stopping.proc.wait(timeout=60) == 0
        for sid in running:
            assert store.header(sid).status.value == "completed", "a step in flight finished before the exit"
        waiting = depth(store.client, store.keys.celery_prefix)
        fleet.start()
        for sid in running + late:
            wait_for(lambda sid=sid: store.header(sid).status.value != "active", timeout=60, what=f"{sid} to end")
            check_invariants(store, sid)
        report("sigterm_in_flight", late_left_in_queue=waiting)
    finally:
        app.close()
    assert llm_server.count(scenario) == 5, "each model call made once"
