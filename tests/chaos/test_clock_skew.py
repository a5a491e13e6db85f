"""Workers whose wall clocks are off by an hour (`AGENTS_FAULT_CLOCK_SHIFT`): deadlines and owed
steps must keep Redis's time, so no approval expires early or late and no lost step waits an hour."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.model import AgentSpec
from tests.chaos.conftest import Fleet, report
from tests.chaos.invariants import check_invariants
from tests.e2e.conftest import wait_for
from tests.scheduler.fakes import RecordingTools, ScriptedLlm, llm_turn, make_agent
from tests.support.llm_server import LlmServer, Reply, calls, text

pytestmark = pytest.mark.slow

HOUR = 3600


def approval_agent(timeout_s: float) -> AgentSpec:
    defer = {"tag": "defer", "timeoutSeconds": timeout_s}
    return make_agent({"default": "runSync", "rules": [{"tool": "defer_t", "disposition": defer}]})


def sweeps_by(fleet: Fleet, name: str, count: int) -> None:
    """Wait until the worker's services loop ran `count` more times (each writes a heartbeat, then sweeps)."""
    seen: set[str] = set()

    def beat() -> bool:
        raw = fleet.client.hget(f"{fleet.prefix}:workers", name)
        if raw:
            seen.add(str(json.loads(raw)["at"]))
        return len(seen) > count

    wait_for(beat, timeout=30, what=f"{count} sweeps by {name}")


def waiting_approval(client: Client) -> tuple[str, str]:
    """A session made here (this host's clock is right) whose deferred call waits for approval."""
    sid = client.start(approval_agent(1800), "pay", step=True).session_id
    client.step(sid)
    (pending,) = client.pending(sid)
    assert pending.token
    return sid, pending.token


def test_a_fast_sweeper_expires_no_approval_early(fleet: Fleet, chaos_settings: Settings) -> None:
    fast = fleet.start(AGENTS_FAULT_CLOCK_SHIFT=str(HOUR))
    llm = ScriptedLlm(llm_turn(("c1", "defer_t", "{}")), llm_turn(text="paid"))
    with Client(chaos_settings, inline=True, llm=llm, tools=RecordingTools()) as client:
        sid, token = waiting_approval(client)
        made = time.monotonic()
        sweeps_by(fleet, fast.name, 3)
        expired = [e for e in client.store.read_events(sid) if e["type"] == "token_expired"]
        report("fast sweeper", seconds_watched=round(time.monotonic() - made, 2), expired=len(expired))
        assert expired == [], "an approval with 1800 s to go was expired by a worker whose clock runs an hour ahead"
        assert client.complete(token, "yes").accepted
        assert client.step(sid).response == "paid"
        check_invariants(client.store, sid)


def test_a_slow_sweeper_expires_a_due_approval_on_time(fleet: Fleet, chaos_settings: Settings) -> None:
    fleet.start(AGENTS_FAULT_CLOCK_SHIFT=str(-HOUR))
    llm = ScriptedLlm(llm_turn(("c1", "defer_t", "{}")), llm_turn(text="no answer came"))
    with Client(chaos_settings, inline=True, llm=llm, tools=RecordingTools()) as client:
        sid = client.start(approval_agent(1), "pay", step=True).session_id
        client.step(sid)
        made = time.monotonic()
        # Expired only by the worker's sweeper: this client does not look at deadlines while it waits.
        wait_for(lambda: client.store.header(sid).state.value == "ready", timeout=20, what="the 1 s approval to expire")
        report("slow sweeper", expired_after_s=round(time.monotonic() - made, 2))
        assert client.step(sid).response == "no answer came"
        check_invariants(client.store, sid)


def test_a_step_owed_by_a_fast_worker_is_recovered_without_waiting_an_hour(
    fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    def reply(body: dict[str, Any]) -> Reply:
        return text("done") if body["messages"][-1]["role"] == "tool" else calls(("sync_tool", {"city": "Paris"}))

    scenario = llm_server.scenario([reply])
    tool = {"name": "sync_tool", "description": "t", "python": "celery_agents.tools.demo:get_weather"}
    path = write_agent({"slug": "skew", "model": f"openai/{scenario}", "apiBase": llm_server.url, "tools": [tool]})
    doomed = fleet.start(AGENTS_FAULT_CLOCK_SHIFT=str(HOUR), AGENTS_FAULT_PAUSE="after_commit")
    with Client(chaos_settings, inline=False) as client:
        store = client.store
        sid = client.start(path, "go", run=True, wait=False).session_id
        wait_for(lambda: store.client.get(store.keys.fault("after_commit")) == sid, what="the commit checkpoint")
        doomed.kill()  # its next step was owed, never published
        fleet.start()
        ready = time.monotonic()
        # Before Redis's clock scored it, the entry looked owed an hour from now: nothing for an hour.
        wait_for(lambda: store.header(sid).status.value != "active", timeout=90, what="the owed step's recovery")
        report("owed by a fast clock", finished_after_ready_s=round(time.monotonic() - ready, 2))
        check_invariants(store, sid)
