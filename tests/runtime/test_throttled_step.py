"""`run_step` under fleet limits, on real Redis with a scripted model: a step whose model call may
not start gives its lease back and stays owed from its start time (the sweeper leaves it alone
until then and publishes it again after, if its message was lost); coming back it is admitted, its
slot given back with the commit; a 429 with Retry-After pauses the model and puts the step back;
no limit costs no Redis command, a limit one round trip."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from celery_agents.model import State
from celery_agents.model.admission import ModelLimit
from celery_agents.runtime import run_step
from celery_agents.scheduler import LlmFailure
from celery_agents.store import Store, client_for_url
from celery_agents.store.counters import read_counters
from celery_agents.store.records import Waiter
from celery_agents.tasks.services import sweep_once
from tests.scheduler.fakes import RecordingTools, ScriptedLlm, llm_turn
from tests.store.scenario import AGENT, start
from tests.support.redis_server import RedisServer


class Published:
    """A dispatcher that records what the sweeper publishes."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, int, str, int]] = []

    def step(self, session_id: str, version: int, request: str = "", priority: int = 5, countdown: Any = None) -> None:
        self.steps.append((session_id, version, request, priority))

    def call(self, session_id: str, call: Any) -> None:
        raise AssertionError("no call is dispatched here")


def fill(store: Store, key: str) -> None:
    """Another session's call holds the KEY's one slot."""
    assert store.admit(AGENT.model, [key], 0, "other:1:slot", Waiter("other", 1, 5)).admitted


def commands(store: Store) -> int:
    stats = store.client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")


def test_a_step_that_must_wait_is_put_back_owed_from_its_start_and_swept_only_after_it(store: Store) -> None:
    store = Store(store.client, replace(store.settings, limits_refresh=0.0, owed_grace=1.0, lost_grace=300.0))
    store.set_limit(AGENT.model, ModelLimit(rpm=1))  # one call a minute
    fill(store, AGENT.model)
    sid = start(store, drive="auto", owe=True)
    llm = ScriptedLlm(llm_turn(text="hello"))
    res = run_step(store, sid, 1, llm=llm, tools=RecordingTools(), owner="w1")
    assert res.outcome == "throttled" and res.throttled is not None and res.throttled.requeue
    assert llm.calls == 0, "the model was not called"
    until = res.throttled.until
    assert 59 < until - res.throttled.now <= 60.01
    header = store.header(sid)
    assert header.throttled_until == pytest.approx(until, abs=1e-3) and header.state == State.READY
    assert store.lease_holder(sid) is None, "its thread and its lease were given back"
    assert store.client.zscore(store.keys.owed, sid) == int(until * 1000)
    [event] = [e for e in store.read_events(sid) if e["type"] == "step_throttled"]
    assert (event["reason"], event["key"]) == ("rate", AGENT.model)
    assert event["until"] == pytest.approx(until, abs=1e-3)
    counted = read_counters(store.client, store.keys)
    assert counted[("model_calls_throttled", AGENT.model)] == 1 and counted[("steps", "throttled")] == 1

    # Its message is held by a worker's timer: the sweeper leaves it alone until its time has come
    # and gone by the grace; then (its message lost with a dead worker) it publishes it again.
    published = Published()
    assert sweep_once(store, published, store.settings, now=until - 1)["owed"] == 0  # type: ignore[arg-type]
    assert sweep_once(store, published, store.settings, now=until + 2)["owed"] == 1  # type: ignore[arg-type]
    assert published.steps == [(sid, 1, "sweeper", 5)]


def test_a_step_coming_back_is_admitted_and_gives_its_slot_back_with_its_commit(store: Store) -> None:
    store = Store(store.client, replace(store.settings, limits_refresh=0.0))
    store.set_limit(AGENT.model, ModelLimit(concurrency=1))
    fill(store, AGENT.model)
    sid = start(store, drive="auto", owe=True)
    llm = ScriptedLlm(llm_turn(text="hello"))
    res = run_step(store, sid, 1, llm=llm, tools=RecordingTools(), owner="w1")
    assert res.outcome == "throttled" and res.throttled is not None
    assert (res.throttled.reason, res.throttled.requeue) == ("concurrency", False), "a released slot wakes it"
    released = store.release(store_held("other:1:slot"))
    assert released.woken == (Waiter(sid, 1, 5),)
    res = run_step(store, sid, 1, llm=llm, tools=RecordingTools(), owner="w1", request="woken")
    assert (res.outcome, res.state) == ("committed", State.COMPLETED)
    assert store.header(sid).throttled_until is None
    assert store.limit_usages()[0].in_flight == 0, "its slot went back with the commit"


def store_held(slot: str) -> Any:
    from celery_agents.store.admission import HeldCall

    return HeldCall(AGENT.model, (AGENT.model,), slot, 0)


def test_a_429_with_retry_after_pauses_the_model_and_puts_the_step_back(store: Store) -> None:
    store = Store(store.client, replace(store.settings, limits_refresh=0.0))
    store.set_limit(AGENT.model, ModelLimit(concurrency=3))
    sid = start(store, drive="auto", owe=True)
    refused = LlmFailure("rate_limited", "slow down", transient=True, retry_after=5.0, model=AGENT.model)
    llm = ScriptedLlm(refused, llm_turn(text="hello"))
    res = run_step(store, sid, 1, llm=llm, tools=RecordingTools(), owner="w1")
    assert res.outcome == "throttled" and res.throttled is not None
    assert res.throttled.reason == "paused" and 4.9 < res.throttled.countdown <= 5.0
    assert [p.model for p in store.pauses()] == [AGENT.model]
    assert store.header(sid).status.value == "active", "the session does not fail"
    assert store.limit_usages()[0].in_flight == 0, "the refused call's slot was given back"
    other = start(store, drive="auto", owe=True)
    res = run_step(store, other, 1, llm=llm, tools=RecordingTools(), owner="w2")
    assert res.outcome == "throttled" and res.throttled is not None and res.throttled.reason == "paused"
    assert llm.calls == 1, "another session's call waits for the pause too"


def test_no_limit_costs_a_step_no_command_and_a_limit_one_round_trip(store: Store, tmp_path: Path) -> None:
    # A Redis of its own: INFO commandstats counts every client's commands, other tests' too.
    server = RedisServer(tmp_path / "redis").start()
    try:
        client = client_for_url(server.url)
        store = Store(client, replace(store.settings, redis_url=server.url, limits_refresh=3600.0))
        count_step_commands(store)
        client.close()
    finally:
        server.stop(kill=True)


def count_step_commands(store: Store) -> None:
    store.fleet_limits()  # this process's copy of the limits: read once an hour here
    trips: list[str] = []
    original = store.scripts.run

    def counting(name: str, keys: list[str], args: list[Any], client: Any = None) -> Any:
        trips.append(name if client is None else f"{name} (pipelined)")
        return original(name, keys, args, client)

    store.scripts.run = counting  # type: ignore[method-assign]

    def step_commands() -> tuple[int, list[str]]:
        sid = start(store)
        trips.clear()
        before = commands(store)
        res = run_step(store, sid, 1, llm=ScriptedLlm(llm_turn(text="hi")), tools=RecordingTools(), owner="w1")
        assert res.outcome == "committed"
        return commands(store) - before, list(trips)

    step_commands()  # scripts loaded
    off, off_trips = step_commands()
    store.set_limit(AGENT.model, ModelLimit(rpm=100_000))
    step_commands()  # this process reads the limits again: they changed
    rpm, rpm_trips = step_commands()
    store.set_limit(AGENT.model, ModelLimit(rpm=100_000, tpm=10_000_000, concurrency=100))
    step_commands()
    every, every_trips = step_commands()
    print(
        f"Redis commands of a one-call step: {off} under no limit, {rpm} under rpm, {every} under rpm+tpm+concurrency"
    )
    assert off_trips == ["begin_step", "commit_step"], "no limit: nothing more than the step's two round trips"
    # a rate of requests is all counted by the admission; a slot or tokens are ended with the commit
    assert rpm_trips == ["begin_step", "admit", "commit_step"]
    assert every_trips == ["begin_step", "admit", "commit_step (pipelined)", "release (pipelined)"]
    assert rpm - off <= 6 and every - off <= 18


def test_a_step_run_inline_waits_in_its_process_and_goes_on(store: Store) -> None:
    from celery_agents import Client

    settings = replace(store.settings, limits_refresh=0.0, limits_burst=0.05)
    store.set_limit(AGENT.model, ModelLimit(rpm=120))  # 500 ms apart, one at a time
    llm = ScriptedLlm(llm_turn(text="one"), llm_turn(text="two"))
    with Client(settings, inline=True, llm=llm, tools=RecordingTools()) as client:
        started = time.monotonic()
        first = client.start(AGENT, "first", run=True)
        second = client.start(AGENT, "second", run=True)
        both = time.monotonic() - started  # the two calls are 500 ms apart (less the 50 ms burst)
        events = [e["type"] for e in client.events(second.session_id)]
    assert (first.response, second.response) == ("one", "two")
    assert 0.4 < both < 5, "the second call waited its turn, here"
    assert "step_throttled" in events and second.throttled_until is None
