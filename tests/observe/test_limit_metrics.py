"""`/metrics` (the same families for `agents serve` and a worker) shows the fleet's limits, their
use, the calls in flight and waiting, the paused models, and the calls each limit made wait (counted
by the step a limit put back)."""

from __future__ import annotations

import time
from dataclasses import replace

from celery_agents import Client
from celery_agents.model.admission import ModelLimit
from celery_agents.runtime import run_step
from celery_agents.store import Store
from celery_agents.store.records import Waiter
from celery_agents.tools.resolve import parse_agent
from celery_agents.web.metrics import registry_for, render
from tests.scheduler.fakes import RecordingTools, ScriptedLlm, llm_turn
from tests.store.scenario import start

AGENT = parse_agent({"slug": "limited", "model": "openai/m"})


def scrape(store: Store) -> dict[str, float]:
    with Client(store.settings, inline=False) as client:
        lines = render(registry_for(client)).decode().splitlines()
    return {name: float(value) for name, value in (x.rsplit(" ", 1) for x in lines if x.startswith("agents_model"))}


def test_limits_their_use_and_their_waits_are_served(store: Store) -> None:
    store = Store(store.client, replace(store.settings, limits_refresh=0.0))
    store.set_limit("openai/m", ModelLimit(rpm=60, concurrency=1))
    store.set_limit("team-a", ModelLimit(tpm=1000))
    admitted = time.monotonic()
    assert store.admit("openai/m", ["openai/m", "team-a"], 300, "s1:1:x", Waiter("s1", 1, 5)).admitted
    before = scrape(store).get('agents_model_calls_throttled_total{key="openai/m"}', 0.0)
    # a step whose model call the full concurrency limit holds: put back, and counted as it is
    sid = start(store, agent=AGENT, drive="auto", owe=True)
    llm = ScriptedLlm(llm_turn(text="later"))
    put_back = run_step(store, sid, 1, llm=llm, tools=RecordingTools(), owner="w1")
    assert put_back.outcome == "throttled" and llm.calls == 0
    store.pause_model("openai/other", 30)
    got = scrape(store)
    since = time.monotonic() - admitted  # the booking runs down by this much before the scrape reads it
    assert got['agents_model_limit{key="openai/m",kind="rpm"}'] == 60
    assert got['agents_model_limit{key="openai/m",kind="concurrency"}'] == 1
    assert got['agents_model_limit{key="team-a",kind="tpm"}'] == 1000
    assert got['agents_model_limit_used{key="openai/m",kind="requests"}'] == 1
    assert got['agents_model_limit_used{key="team-a",kind="tokens"}'] == 300
    assert got['agents_model_limit_in_flight{key="openai/m"}'] == 1
    assert got['agents_model_limit_waiting{key="openai/m"}'] == 1
    assert 0.99 - since < got['agents_model_limit_booked_seconds{key="openai/m"}'] <= 1.0
    assert 29 < got['agents_model_paused_seconds{model="openai/other"}'] <= 30
    assert got['agents_model_calls_throttled_total{key="openai/m"}'] == before + 1
