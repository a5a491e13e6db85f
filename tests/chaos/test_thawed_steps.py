"""A worker frozen (SIGSTOP) with 150 steps begun and about to call the model, for more than three
times the lease; a second worker completes every session; then thawed (SIGCONT). The thawed steps
process sends the model nothing: before a model call a step checks its lease against a local
deadline (its last renewal plus the lease, less a margin) and, that deadline past, asks Redis,
instead of trusting a renewal thread that may run only after it."""

from __future__ import annotations

import os
import signal
import time

import pytest

from celery_agents.config import Settings
from celery_agents.model import UserQuery
from celery_agents.store import Store
from celery_agents.tasks.config import Dispatcher, make_app
from celery_agents.tools.resolve import parse_agent
from tests.chaos.conftest import Fleet, report
from tests.chaos.invariants import check_invariants
from tests.e2e.conftest import wait_for
from tests.support.llm_server import LlmServer, text

pytestmark = pytest.mark.slow

SESSIONS = 150
#: how long each step of the first worker stays at the checkpoint `step_begun` (its lease held and
#: renewed, its model call next): longer than taking up all the steps takes, shorter than the freeze
PAUSE_S = 8.0


def test_a_thawed_steps_process_asks_the_model_nothing_for_sessions_taken_over(
    fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer
) -> None:
    scenario = llm_server.scenario([text("done")])
    agent = parse_agent({"slug": "thawed", "model": f"openai/{scenario}", "apiBase": llm_server.url})
    frozen = fleet.start(AGENTS_FAULT_PAUSE="step_begun", AGENTS_FAULT_PAUSE_SECONDS=str(PAUSE_S))
    store = Store(fleet.client, chaos_settings)
    app = make_app(chaos_settings, main="chaos_thawed")
    try:
        sids = [
            store.create_session(agent, UserQuery(text="go"), drive="auto", owe=True).session_id
            for _ in range(SESSIONS)
        ]
        leases = [store.keys.lease(sid) for sid in sids]
        for sid in sids:
            Dispatcher(app).step(sid, 1)
        wait_for(lambda: any(fleet.client.mget(leases)), timeout=60, what="the first step to begin")
        first_begun = time.monotonic()
        wait_for(lambda: all(fleet.client.mget(leases)), timeout=60, what=f"all {SESSIONS} steps to begin")
        assert llm_server.count(scenario) == 0, "every step waits at its checkpoint, before its model call"
        assert frozen.proc is not None
        os.killpg(frozen.proc.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            fleet.start()
            wait_for(
                lambda: all(store.header(s).status.value == "completed" for s in sids),
                timeout=120,
                what="the second worker to complete every session",
            )
            # Thawed only once every step's pause is over and three leases have passed: each of
            # them goes straight on to its model call.
            end = max(first_begun + PAUSE_S, frozen_at + 3 * chaos_settings.lease_seconds) + 0.5
            time.sleep(max(0.0, end - time.monotonic()))
            before = llm_server.count(scenario)
        finally:
            os.killpg(frozen.proc.pid, signal.SIGCONT)
        thawed_at = time.monotonic()
        log = fleet.logdir / "worker0.log"
        wait_for(
            lambda: all(f"step of session {sid} at version" in log.read_text() for sid in sids),
            timeout=60,
            what="the thawed worker to end every step it held",
        )
        after = llm_server.count(scenario) - before
        report(
            "thawed_steps",
            frozen_s=round(thawed_at - frozen_at, 1),
            model_requests_before_thaw=before,
            model_requests_after_thaw=after,
        )
        assert before == SESSIONS, "the second worker asked the model once per session"
        assert after == 0, f"the thawed process sent {after} model requests for sessions completed elsewhere"
        for sid in sids:
            check_invariants(store, sid)
    finally:
        app.close()
