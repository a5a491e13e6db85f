"""Step messages are taken without acknowledgement (Redis broker): once a worker has one, the broker
holds nothing of it. What must hold instead: a worker takes no more step messages than it has
free threads (a killed worker takes nothing but its running steps with it); the sweeper publishes
again the step of a worker that died after taking its message and before `begin_step`; and a copy
published again never runs beside the one it replaces — the late one does nothing."""

from __future__ import annotations

import os
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
from tests.e2e.conftest import runs, wait_for
from tests.support.llm_server import HeldModel, LlmServer
from tests.support.queues import depth

pytestmark = pytest.mark.slow


def _broker_holds(store: Store, queue: str = "steps") -> tuple[int, int]:
    """(messages waiting in `queue`, messages kombu tracks as taken and unacknowledged)."""
    prefix = store.keys.celery_prefix
    return depth(store.client, prefix, queue), int(store.client.hlen(f"{prefix}unacked"))


def test_a_steps_worker_takes_no_more_step_messages_than_its_threads(
    fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer
) -> None:
    threads, sessions = 3, 8
    model = HeldModel()
    scenario = llm_server.scenario([model])
    spec = parse_agent({"slug": "held", "model": f"openai/{scenario}", "apiBase": llm_server.url})
    doomed = fleet.start(step_threads=threads)
    store = Store(fleet.client, chaos_settings)
    app = make_app(chaos_settings, main="chaos_step_messages")
    try:
        sids = [
            store.create_session(spec, UserQuery(text="go"), drive="auto", owe=True).session_id for _ in range(sessions)
        ]
        for sid in sids:
            Dispatcher(app).step(sid, 1)
        wait_for(lambda: model.holding == threads, what=f"{threads} model calls in flight")
        time.sleep(1.5)  # time enough to take more, if it would
        assert model.holding == threads
        assert _broker_holds(store) == (sessions - threads, 0), "the rest wait in the queue, none is tracked"
        killed_at = time.monotonic()
        doomed.kill()
        model.released.set()
        assert _broker_holds(store)[0] == sessions - threads, "the killed worker took no waiting message with it"
        fleet.start()
        for sid in sids:
            wait_for(lambda sid=sid: store.header(sid).status.value != "active", timeout=60, what=f"{sid} to end")
            check_invariants(store, sid)
        report("held_by_threads", threads=threads, recovery_s=round(time.monotonic() - killed_at, 2))
    finally:
        model.released.set()
        app.close()
    assert llm_server.count(scenario) == sessions + threads, "the three running steps asked the model again"


def test_a_worker_killed_after_taking_a_step_message_loses_no_step(
    fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    log = tmp_path / "runs.jsonl"
    scenario = llm_server.scenario([conversation()])
    path = write_agent(agent(scenario, llm_server.url, log))
    doomed = fleet.start(AGENTS_FAULT_PAUSE="step_taken")
    with Client(chaos_settings, inline=False) as client:
        store = client.store
        sid = client.start(path, "go", run=True, wait=False).session_id
        wait_for(lambda: store.client.get(store.keys.fault("step_taken")) == sid, what="the step message to be taken")
        assert _broker_holds(store) == (0, 0), "the broker holds nothing of a step message a worker took"
        assert store.client.zscore(store.keys.owed, sid) is not None, "the step is owed"
        killed_at = time.monotonic()
        doomed.kill()
        fleet.start()
        ready_at = time.monotonic()  # the sweeper runs in a live worker: from now on
        wait_for(lambda: store.header(sid).status.value != "active", timeout=60, what="a fresh worker to finish")
        recovery, takeover = time.monotonic() - killed_at, time.monotonic() - ready_at
        check_invariants(store, sid)
        assert store.header(sid).response == "done"
        started = [e for e in store.read_events(sid) if e["type"] == "step_started"]
        assert started[0]["request"] == "sweeper", "the first step ran from the sweeper's copy"
    assert llm_server.count(scenario) == 2
    assert [len(runs(log, t, phase="start")) for t in ("sync_tool", "async_tool")] == [1, 1]
    report("killed_after_taking", recovery_s=round(recovery, 2), after_fresh_worker_ready_s=round(takeover, 2))


def test_a_late_copy_of_a_step_published_again_does_nothing(
    fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    """A worker frozen (SIGSTOP) after taking a step message, not dead: the sweeper publishes the
    step again, another worker runs the session to its end, and the frozen worker's copy, once it
    goes on, is refused."""
    log = tmp_path / "runs.jsonl"
    scenario = llm_server.scenario([conversation()])
    path = write_agent(agent(scenario, llm_server.url, log))
    frozen = fleet.start(AGENTS_FAULT_PAUSE="step_taken", AGENTS_FAULT_PAUSE_SECONDS="3")
    assert frozen.proc is not None
    with Client(chaos_settings, inline=False) as client:
        store = client.store
        sid = client.start(path, "go", run=True, wait=False).session_id
        wait_for(lambda: store.client.get(store.keys.fault("step_taken")) == sid, what="the step message to be taken")
        os.killpg(frozen.proc.pid, signal.SIGSTOP)  # within its 3 s at the checkpoint
        try:
            fleet.start()
            wait_for(lambda: store.header(sid).status.value != "active", timeout=60, what="the other worker to finish")
        finally:
            os.killpg(frozen.proc.pid, signal.SIGCONT)
        first = next(e for e in store.read_events(sid) if e["type"] == "step_committed" and e["from_version"] == 1)
        assert first["request"] == "sweeper", "the step ran from the sweeper's copy"

        def late_copy_refused() -> bool:
            return any(
                e["type"] == "step_skipped" and e["request"] == "drive" and e["at_version"] == 1
                for e in store.read_events(sid)
            )

        wait_for(late_copy_refused, timeout=30, what="the frozen worker's copy to be refused")
        check_invariants(store, sid)
    assert llm_server.count(scenario) == 2, "each model call made once"
    assert [len(runs(log, t, phase="start")) for t in ("sync_tool", "async_tool")] == [1, 1]
