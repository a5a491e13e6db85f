"""A worker frozen (SIGSTOP) in the middle of a step, long enough for its lease to lapse and a
second worker to finish the session; then thawed (SIGCONT). The zombie must start no further
tool and leave nothing behind."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from tests.chaos.conftest import Fleet, report
from tests.chaos.invariants import check_invariants
from tests.e2e.conftest import record_tool, runs, wait_for
from tests.support.llm_server import LlmServer, Reply, calls, text

pytestmark = pytest.mark.slow


def three_tools(body: dict[str, Any]) -> Reply:
    if body["messages"][-1]["role"] == "tool":
        return text("done")
    return calls(("tool1", {"x": 1, "sleep": 3}), ("tool2", {"x": 2}), ("tool3", {"x": 3}))


def test_a_thawed_worker_runs_no_tool_after_losing_its_lease(
    fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    log = tmp_path / "runs.jsonl"
    scenario = llm_server.scenario([three_tools])
    path = write_agent(
        {
            "slug": "zombie",
            "model": f"openai/{scenario}",
            "apiBase": llm_server.url,
            "tools": [record_tool(n, log) for n in ("tool1", "tool2", "tool3")],
        }
    )
    zombie = fleet.start()
    with Client(chaos_settings, inline=False) as client:
        store = client.store
        sid = client.start(path, "go", run=True, wait=False).session_id
        wait_for(lambda: runs(log, "tool1", phase="start"), what="tool1 to start on the first worker")
        assert zombie.proc is not None
        os.killpg(zombie.proc.pid, signal.SIGSTOP)
        try:
            fleet.start()
            wait_for(lambda: store.header(sid).status.value != "active", timeout=90, what="the second worker")
            check_invariants(store, sid)
        finally:
            os.killpg(zombie.proc.pid, signal.SIGCONT)
        zombie_log = fleet.logdir / "worker0.log"
        ended = f"step of session {sid} at version"  # what run_step logs when a step ends uncommitted
        wait_for(lambda: ended in zombie_log.read_text(), timeout=60, what="the thawed worker to end its step")
        starts = {t: len(runs(log, t, phase="start")) for t in ("tool1", "tool2", "tool3")}
        report("zombie", tool_starts=starts)
        assert starts == {"tool1": 2, "tool2": 1, "tool3": 1}, "the thawed worker started no further tool"
        journal = store.keys.journal(sid)
        assert store.client.ttl(journal) != -1, "no journal key is left without a time to live"
        check_invariants(store, sid)
