"""SIGTERM is a soft shutdown: the step in flight finishes and commits before the worker exits, and
what the session owes next is picked up by another worker."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from tests.chaos.conftest import Fleet, report
from tests.chaos.invariants import check_invariants
from tests.chaos.test_kill_worker import agent, conversation
from tests.e2e.conftest import wait_for
from tests.support.llm_server import LlmServer

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
