"""Fleet limits and priority on real worker processes (two of them: a limit holds across the
fleet), a real Redis and the scripted model server.

Time runs ten times faster than a provider's: a minute of the provider's is a 6 s window here, and
both the provider's limit and ours are counted per 6 s; the burst a limit lets start at once is
scaled with it (AGENTS_LIMITS_BURST 0.1 s instead of a second). What the test asks is the same
either way: no window below 90% of the limit, the whole run within 5% of it on average, and the
provider's 429s at most two. Ten times faster it asks more: the delays of a loaded machine (a
countdown fired late, a thread scheduled late: tens of ms) are ten times larger against the
spacing of the calls. How evenly the limiter spaces what it admits is the store's test
(tests/store/test_admission.py); at the provider, a starved worker sending admitted calls late
bunched them once, 36 calls in one window of a full suite on two cores, its average still 1.02.
At a provider's own scale, several whole 60 s windows of 40 sessions would take minutes.

The workers read the fleet's limits at every model call (AGENTS_LIMITS_REFRESH=0): a limit set
applies to the next call, with no copy of the limits to wait out (how long a copy is trusted is
tested with the store, tests/store/test_admission.py)."""

from __future__ import annotations

import datetime
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.model import State
from celery_agents.store.counters import read_counters
from tests.cli.process import agents, cli_env
from tests.e2e.conftest import start_workers, wait_for
from tests.support.llm_server import ClosedModel, LlmServer, RateLimitedModel, calls, text
from tests.support.workers import stop_all

pytestmark = pytest.mark.slow

#: the scaled minute: a provider's limit per minute is a limit per WINDOW seconds here
WINDOW = 6.0
SCALE = 60.0 / WINDOW
#: how long a worker trusts its copy of the limits: not at all, it reads them at every model call
REFRESH = 0.0
#: the threads of the priority test's worker
STEP_THREADS = 8


@pytest.fixture(scope="module")
def fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    prefix = f"lim{uuid.uuid4().hex[:8]}"
    env = {"AGENTS_LIMITS_REFRESH": str(REFRESH), "AGENTS_LIMITS_BURST": str(1.0 / SCALE)}
    workers = start_workers(redis_url, prefix, tmp_path_factory.mktemp("logs"), count=2, concurrency=1, **env)
    yield Settings(
        redis_url=redis_url,
        prefix=prefix,
        home=tmp_path_factory.mktemp("home"),
        limits_refresh=REFRESH,
        limits_burst=1.0 / SCALE,
    )
    stop_all(workers)


def adder(server: LlmServer, model: str, **extra: Any) -> dict[str, Any]:
    """An agent whose model asks for one sum, then answers: two model calls per session."""
    tool = {
        "name": "add",
        "description": "adds two numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        "python": "tests.tools.sample_tools:add",
    }
    return {"slug": "adder", "model": f"openai/{model}", "apiBase": server.url, "tools": [tool], **extra}


def sum_then_answer(body: dict[str, Any]) -> Any:
    answered = any(m.get("role") == "tool" for m in body.get("messages", []))
    return text("the sum is 3") if answered else calls(("add", {"a": 1, "b": 2}))


def settled(client: Client, sids: list[str]) -> list[Any]:
    views = [client.view(s) for s in sids]
    return views if all(v.state in (State.COMPLETED, State.FAILED) for v in views) else []


def limit_applies(client: Client, key: str, **limit: int) -> None:
    """Set a limit: the workers read the limits at every model call, so it holds from the next one."""
    client.set_limit(key, **limit)


def windows(times: list[float], width: float) -> list[int]:
    """How many of `times` fall in each window of `width` s that lies whole within them, sliding:
    one starting at each call and one ending at each call (the fullest and the emptiest windows
    are among these)."""
    first, last = times[0], times[-1]
    starting = [sum(1 for t in times if s <= t < s + width) for s in times if s + width <= last]
    ending = [sum(1 for t in times if e - width < t <= e) for e in times if e - width >= first]
    return starting + ending


def test_forty_sessions_under_a_limit_below_the_providers_run_at_the_limit_and_none_fails(
    fleet: Settings, llm_server: LlmServer, write_agent: Any
) -> None:
    limit_rpm, provider_rpm = 300, 360  # 30 and 36 calls in every 6 s window
    per_window = round(limit_rpm * WINDOW / 60)
    provider = RateLimitedModel(limit=round(provider_rpm * WINDOW / 60), window=WINDOW, answer=sum_then_answer)
    model = llm_server.scenario([provider])
    path = write_agent(adder(llm_server, model))
    with Client(fleet, inline=False) as client:
        limit_applies(client, f"openai/{model}", rpm=limit_rpm)
        sids = [client.start(path, f"add {i}", run=True, wait=False).session_id for i in range(40)]
        waiting = wait_for(lambda: next((v for s in sids if (v := client.view(s)).throttled_until), None))
        until = datetime.datetime.fromisoformat(waiting.throttled_until)
        ahead = (until - datetime.datetime.now(datetime.UTC)).total_seconds()
        assert -1 < ahead < 40, f"a waiting session shows when its call may start: {waiting.throttled_until}"
        views = wait_for(lambda: settled(client, sids), timeout=90, what="the 40 sessions to end")
        counted = read_counters(client.store.client, client.store.keys)
    assert [v.state for v in views] == [State.COMPLETED] * 40, [v.error for v in views if v.error]
    assert provider.refused <= 2, f"{provider.refused} requests got a 429"
    times = sorted(provider.accepted)
    assert len(times) == 80
    assert times[-1] - times[0] >= 2 * WINDOW, "several whole windows"
    counts = windows(times, WINDOW)
    achieved = (len(times) - 1) / (times[-1] - times[0]) * WINDOW / per_window
    print(
        f"calls per {WINDOW:g} s window, sliding: {min(counts)} to {max(counts)} (limit {per_window}, "
        f"{len(counts)} windows); achieved/limit {achieved:.3f}"
    )
    assert all(n >= 0.9 * per_window for n in counts), sorted(counts)  # the fleet keeps the limit's pace
    assert 0.9 <= achieved <= 1.05, f"achieved/limit {achieved:.3f}"  # and takes no more than it
    assert counted[("model_calls_throttled", f"openai/{model}")] >= 40, "most calls waited their turn"


def test_a_concurrency_limit_of_one_never_has_two_calls_in_flight(
    fleet: Settings, llm_server: LlmServer, write_agent: Any
) -> None:
    provider = RateLimitedModel(limit=10_000, window=1.0, answer=lambda body: text("done"), delay=0.25)
    model = llm_server.scenario([provider])
    team = f"team-{uuid.uuid4().hex[:6]}"
    path = write_agent(adder(llm_server, model, limitKey=team))
    with Client(fleet, inline=False) as client:
        limit_applies(client, team, concurrency=1)
        started = time.monotonic()
        sids = [client.start(path, f"go {i}", run=True, wait=False).session_id for i in range(6)]
        views = wait_for(lambda: settled(client, sids), timeout=60, what="the sessions to end")
        took = time.monotonic() - started
        usage = client.limits()[0]
    assert [v.state for v in views] == [State.COMPLETED] * 6
    assert provider.most_in_flight == 1, "the limit holds across both workers"
    assert took >= 6 * 0.25
    mine = next(u for u in usage if u.key == team)
    assert (mine.in_flight, mine.waiting) == (0, 0), "every slot was given back, no step is left waiting"


def test_a_429_with_retry_after_pauses_that_model_for_the_other_sessions(
    fleet: Settings, llm_server: LlmServer, write_agent: Any
) -> None:
    closed = ClosedModel(seconds=2.0)
    model = llm_server.scenario([closed])
    path = write_agent({"slug": "paused", "model": f"openai/{model}", "apiBase": llm_server.url})
    with Client(fleet, inline=False) as client:
        first = client.start(path, "first", run=True, wait=False).session_id
        wait_for(lambda: closed.requests, what="the first call's 429")
        pause = wait_for(lambda: client.store.pauses(), what="the pause in Redis")
        assert pause[0].model == f"openai/{model}"
        others = [client.start(path, f"then {i}", run=True, wait=False).session_id for i in range(4)]
        views = wait_for(lambda: settled(client, [first, *others]), timeout=60, what="the sessions to end")
        counted = read_counters(client.store.client, client.store.keys)
    assert [v.state for v in views] == [State.COMPLETED] * 5, [v.error for v in views]
    assert closed.closed_until is not None
    # The first call got its 429; the others asked only once the pause was over (a worker whose copy
    # of the pauses was a moment old may have asked once: at most a couple).
    assert closed.refused <= 3, closed.requests
    assert counted[("model_calls_throttled", f"openai/{model}")] >= 5


def test_high_priority_sessions_started_after_500_queued_ones_finish_first(
    redis_url: str, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    # One worker of few threads, with a queue of its own: the 500 wait in it.
    prefix = f"pri{uuid.uuid4().hex[:8]}"
    settings = Settings(redis_url=redis_url, prefix=prefix, home=tmp_path / "home")
    [worker] = start_workers(redis_url, prefix, tmp_path, count=1, concurrency=1, step_threads=STEP_THREADS)
    fast = llm_server.scenario([text("at once")])
    low = write_agent({"slug": "batch", "model": f"openai/{fast}", "apiBase": llm_server.url}, "low.json")
    high = write_agent(
        {"slug": "chat", "model": f"openai/{fast}", "apiBase": llm_server.url, "priority": 9}, "high.json"
    )
    try:
        with Client(settings, inline=False) as client:
            completed = client.store.keys.state_index("completed")
            lows = [client.start(low, f"batch {i}", run=True, wait=False, priority=1).session_id for i in range(500)]
            lows_done_then = client.store.client.zcard(completed)
            highs = [client.start(high, f"chat {i}", run=True, wait=False).session_id for i in range(5)]
            wait_for(lambda: settled(client, highs), timeout=60, what="the high-priority sessions to end")
            lows_done = client.store.client.zcard(completed) - len(highs)
            print(
                f"low-priority sessions done: {lows_done_then} when the high ones started, {lows_done} when they ended"
            )
            assert [client.view(s).priority for s in highs] == [9] * 5
            assert [client.view(s).priority for s in lows[:3]] == [1] * 3
            # what the worker's threads held, or took while the high ones were being published, may
            # end meanwhile (a loaded machine publishes slowly: a few threads' worth); without
            # priority every one of the 500 would
            assert lows_done - lows_done_then <= 6 * STEP_THREADS, (lows_done_then, lows_done)
            assert 500 - lows_done >= 100, "most low-priority sessions were still queued"
    finally:
        worker.kill()


def test_a_step_put_back_is_shown_in_its_view_and_events(
    fleet: Settings, llm_server: LlmServer, write_agent: Any
) -> None:
    model = llm_server.scenario([text("done")])
    path = write_agent({"slug": "slowly", "model": f"openai/{model}", "apiBase": llm_server.url})
    with Client(fleet, inline=False) as client:
        limit_applies(client, f"openai/{model}", rpm=1)  # one call a minute
        first = client.start(path, "one", run=True, timeout=30)
        assert first.state == State.COMPLETED
        second = client.start(path, "two", run=True, wait=False).session_id
        view = wait_for(lambda: (v := client.view(second)).throttled_until and v, what="the second to be put back")
        events = [e for e in client.events(second) if e["type"] == "step_throttled"]
        assert events and events[0]["reason"] == "rate" and events[0]["key"] == f"openai/{model}"
        until = datetime.datetime.fromisoformat(view.throttled_until).timestamp()
        assert until == pytest.approx(events[0]["until"], abs=0.01)
        assert 50 < until - time.time() < 61, "it may start a minute after the first"
        assert view.state == State.READY and llm_server.count(model) == 1
        shown = json.dumps(view.to_json())
        human = agents("session", "show", second, env=cli_env(fleet.redis_url, fleet.prefix, fleet.home))
        assert f"throttled until {view.throttled_until}" in human.stdout, human
        client.delete_limit(f"openai/{model}")
        client.cancel(second)
    assert "throttled_until" in shown
