"""A dispatched call's lease is released atomically: a worker whose lease lapsed and was taken
over (between its last look and its release) never deletes the new holder's lease."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis

from celery_agents.config import Settings
from celery_agents.llm import LitellmPort
from celery_agents.model import AgentSpec, CallOutcome, TrackedCall
from celery_agents.runtime import run_call, run_step
from celery_agents.store import Store
from celery_agents.tools import ToolRunner
from celery_agents.tools.resolve import load_agent_file

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo-agent.json"


class TakenOverOnRelease(redis.Redis):
    """Once armed, the next command that touches `key` is followed at once by another worker
    taking that key (the lease lapsed there and then)."""

    key = ""
    armed = False

    def execute_command(self, *args: Any, **options: Any) -> Any:
        out = super().execute_command(*args, **options)
        if self.armed and self.key in args:
            self.armed = False
            super().execute_command("SET", self.key, "worker-b")
        return out


def test_a_lapsed_call_lease_taken_over_is_not_released_by_the_first_worker(settings: Settings) -> None:
    client = TakenOverOnRelease.from_url(settings.redis_url or "", decode_responses=True)
    store = Store(client, settings)
    sid = store.create_session(load_agent_file(DEMO), _query(), drive="manual").session_id
    llm, tools = LitellmPort(), ToolRunner()
    run_step(store, sid, 1, llm=llm, tools=tools, owner="w")
    field = run_step(store, sid, 2, llm=llm, tools=tools, owner="w").dispatch[0].field
    lease_key = store.keys.call_lease(sid, field)

    class ArmWhenDone:
        def run(self, agent: AgentSpec, session_id: str, call: TrackedCall) -> CallOutcome:
            outcome = tools.run(agent, session_id, call)
            client.key, client.armed = lease_key, True  # what comes next is the release
            return outcome

    done = run_call(store, sid, field, ArmWhenDone(), "worker-a", "runAsync")  # type: ignore[arg-type]
    assert done.status == "ok"
    assert client.get(lease_key) == "worker-b", "worker-b's lease survives worker-a's release"
    client.close()


def _query() -> Any:
    from celery_agents.model import UserQuery

    return UserQuery(text="What is the weather in Paris?")


def test_a_second_delivery_that_waited_before_the_lease_does_not_run_the_call_again(settings: Settings) -> None:
    """Two deliveries of one call's message (the sweeper's republish, a redelivery): B finds the
    call unfinished, then stalls (a pause, CPU starvation, a Redis blip) while A takes the lease,
    runs the tool, records the result and lets the lease go. B then gets the free lease: it must
    find the call finished, not run the tool a second time."""
    import threading

    store = Store(redis.Redis.from_url(settings.redis_url or "", decode_responses=True), settings)
    sid = store.create_session(load_agent_file(DEMO), _query(), drive="manual").session_id
    llm, tools = LitellmPort(), ToolRunner()
    run_step(store, sid, 1, llm=llm, tools=tools, owner="w")
    field = run_step(store, sid, 2, llm=llm, tools=tools, owner="w").dispatch[0].field
    runs: list[str] = []

    class Counted:
        def run(self, agent: AgentSpec, session_id: str, call: TrackedCall) -> CallOutcome:
            runs.append(call.call_id)
            return tools.run(agent, session_id, call)

    a_done = threading.Event()
    acquire = store.acquire

    def acquire_after_a(lease: Any, owner: str) -> bool:
        if owner == "worker-b":
            assert a_done.wait(60), "worker-a never finished"
        return acquire(lease, owner)

    store.acquire = acquire_after_a  # type: ignore[method-assign]
    statuses: dict[str, str] = {}

    def deliver(owner: str) -> None:
        statuses[owner] = run_call(store, sid, field, Counted(), owner, "runAsync").status  # type: ignore[arg-type]
        if owner == "worker-a":
            a_done.set()

    b = threading.Thread(target=deliver, args=("worker-b",))
    b_looked = threading.Event()
    look = store.call_to_run

    def looked(session_id: str, at: str) -> Any:
        found = look(session_id, at)
        if threading.current_thread() is b:
            b_looked.set()
        return found

    store.call_to_run = looked  # type: ignore[method-assign]
    b.start()
    assert b_looked.wait(60), "worker-b never looked at the call"
    deliver("worker-a")
    b.join(60)
    assert statuses == {"worker-a": "ok", "worker-b": "already"}
    assert len(runs) == 1, f"the tool ran {len(runs)} times"


def test_a_worker_whose_call_lease_was_taken_over_is_stopped_and_records_nothing(settings: Settings) -> None:
    """Worker A runs a dispatched call and freezes past its lease; the sweeper hands the call to
    worker B, which takes the lease and runs it. A wakes: its tool is stopped (B's run is the one
    that counts) and whatever A's run returns is not recorded; B's is."""
    import dataclasses
    import time

    from celery_agents.tools.cancel import cancelled

    settings = dataclasses.replace(settings, lease_seconds=0.6)
    store = Store(redis.Redis.from_url(settings.redis_url or "", decode_responses=True), settings)
    sid = store.create_session(load_agent_file(DEMO), _query(), drive="manual").session_id
    llm, tools = LitellmPort(), ToolRunner()
    run_step(store, sid, 1, llm=llm, tools=tools, owner="w")
    field = run_step(store, sid, 2, llm=llm, tools=tools, owner="w").dispatch[0].field
    lease_key = store.keys.call_lease(sid, field)
    stopped: list[bool] = []

    class TakenOverWhileRunning:
        def run(self, agent: AgentSpec, session_id: str, call: TrackedCall) -> CallOutcome:
            store.client.set(lease_key, "worker-b")  # A froze; B took the lapsed lease
            deadline = time.monotonic() + 10
            while not cancelled() and time.monotonic() < deadline:
                time.sleep(0.02)  # as the process runner polls the event between its checks
            stopped.append(cancelled())
            return tools.run(agent, session_id, call)

    a = run_call(store, sid, field, TakenOverWhileRunning(), "worker-a", "runAsync")  # type: ignore[arg-type]
    assert stopped == [True], "A's renewal found the lease another's: A's run is stopped"
    assert a.status == "lost" and a.finished is None
    assert store.call_pending(sid, field), "nothing of A's run was recorded"
    assert store.client.get(lease_key) == "worker-b"
    b = run_call(store, sid, field, tools, "worker-b", "runAsync")
    assert b.status == "ok" and not store.call_pending(sid, field)


def test_an_outcome_is_refused_while_another_worker_holds_the_calls_lease(settings: Settings) -> None:
    """The frozen worker's run ended before its renewal noticed the lease was another's: the
    recording itself is fenced. A lease that lapsed with nobody holding it does not stop it."""
    store = Store(redis.Redis.from_url(settings.redis_url or "", decode_responses=True), settings)
    sid = store.create_session(load_agent_file(DEMO), _query(), drive="manual").session_id
    llm, tools = LitellmPort(), ToolRunner()
    run_step(store, sid, 1, llm=llm, tools=tools, owner="w")
    field = run_step(store, sid, 2, llm=llm, tools=tools, owner="w").dispatch[0].field
    body = '{"state": "completed", "result": "from a", "attempts": 1}'
    event = {"call_id": "c", "tool": "get_forecast", "state": "completed"}
    store.client.set(store.keys.call_lease(sid, field), "worker-b")
    assert store.record_result(sid, field, body, event, owner="worker-a").status == "lost"
    assert store.call_pending(sid, field)
    store.client.delete(store.keys.call_lease(sid, field))
    assert store.record_result(sid, field, body, event, owner="worker-a").status == "ok"
    assert not store.call_pending(sid, field)
