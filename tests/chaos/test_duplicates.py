"""Duplicate deliveries: the same step and tool messages published two and three times, and a
broker visibility timeout shorter than a tool call (so the broker itself redelivers a running
call). Step messages are taken without acknowledgement: the broker never tracks, so never
redelivers, a running step (a lost one is the sweeper's, see test_step_messages.py)."""

from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from tests.chaos.conftest import Fleet, report
from tests.chaos.invariants import check_invariants
from tests.chaos.test_kill_worker import agent, conversation
from tests.e2e.conftest import runs, wait_for
from tests.support.llm_server import LlmServer
from tests.support.queues import depth

pytestmark = pytest.mark.slow


def test_duplicates_and_short_visibility_timeout_never_double_transition(
    fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    log = tmp_path / "runs.jsonl"
    # The model takes 5 s and the async tool 3 s: both outlive the 1 s visibility timeout by
    # enough for the broker's restore (every 0.5 s) to redeliver a tracked message even on a busy
    # machine; only the tool call's is tracked.
    scenario = llm_server.scenario([conversation(delay_first=5, async_sleep=3)])
    path = write_agent(agent(scenario, llm_server.url, log))
    fleet.start(concurrency=2, AGENTS_VISIBILITY_TIMEOUT="1", AGENTS_RESTORE_INTERVAL="0.5")
    fleet.start(concurrency=1, AGENTS_VISIBILITY_TIMEOUT="1", AGENTS_RESTORE_INTERVAL="0.5")
    with Client(chaos_settings, inline=False) as client:
        store = client.store
        broker = store.keys.celery_prefix
        sid = client.start(path, "go", run=True, wait=False).session_id
        for _ in range(2):  # three copies of the first step in all
            client.dispatcher.step(sid, 1)
        wait_for(lambda: llm_server.count(scenario) == 1, what="the model call to start")
        for _ in range(3):  # while the step runs (5 s), past the visibility timeout
            assert store.client.hlen(f"{broker}unacked") == 0, "the broker tracks no step message a worker runs"
            time.sleep(0.5)
        wait_for(lambda: runs(log, "async_tool", phase="start"), what="the async tool to start")
        (running,) = [c for c in store.pending_calls(sid) if c.tool == "async_tool"]
        for _ in range(2):  # three copies of the tool message in all
            client.dispatcher.call(sid, running)
        wait_for(lambda: store.header(sid).status.value == "completed", timeout=60, what="the session to finish")
        check_invariants(store, sid)
        # Every copy, including those the broker redelivered, has been taken and acknowledged.
        wait_for(
            lambda: (
                store.client.hlen(f"{broker}unacked") == 0
                and sum(depth(store.client, broker, q) for q in ("steps", "tools")) == 0
            ),
            timeout=30,
            what="every copy to be acknowledged",
        )
        skipped = [e for e in store.read_events(sid) if e["type"] == "step_skipped"]
        check_invariants(store, sid)
    # The two copies of the first step published by hand.
    assert len(skipped) >= 2
    received = Counter(re.findall(r"Task celery_agents\.run_call\[([0-9a-f-]+)\] received", _logs(tmp_path)))
    assert max(received.values()) >= 2, f"the broker redelivered the running tool call: {received}"
    assert llm_server.count(scenario) == 2, "each model call made once"
    assert len(runs(log, "sync_tool", phase="start")) == 1
    assert len(runs(log, "async_tool", phase="start")) == 1
    report("duplicates", skipped_copies=len(skipped))


def _logs(folder: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(folder.glob("worker*.log")))
