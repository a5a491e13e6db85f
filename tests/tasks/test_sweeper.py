"""The sweeper (`tasks.services.sweep_once`) on real Redis with real Celery publishing: work lost
between commit and publish goes again soon even while its queue is busy; work that may still be
waiting in the queue is left alone until `lost_grace`. (Another kind of broker: see
tests/e2e/test_other_broker.py.)"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from celery_agents.config import Settings
from celery_agents.store import Store, client_for_url
from celery_agents.tasks.config import Dispatcher, make_app
from celery_agents.tasks.services import AfterOutage, sweep_once
from tests.e2e.conftest import wait_for
from tests.store.scenario import begin, start, waiting_on
from tests.support.queues import messages
from tests.support.redis_server import RedisServer


@pytest.fixture(params=["state-redis", "broker-url"])
def sweeper_settings(request: pytest.FixtureRequest, settings: Settings) -> Settings:
    """The broker is the state Redis, or the same Redis named again by `AGENTS_BROKER_URL`."""
    broker = settings.redis_url if request.param == "broker-url" else None
    return replace(settings, owed_grace=1.0, lost_grace=300.0, clock_skew=1.0, broker_url=broker)


@pytest.fixture
def dispatcher(sweeper_settings: Settings) -> Iterator[Dispatcher]:
    app = make_app(sweeper_settings, main="sweeper-test")
    yield Dispatcher(app)
    app.close()


def queued(store: Store, queue: str) -> list[dict[str, object]]:
    """The messages waiting in a queue, oldest first: task name and arguments."""
    out = []
    for message in messages(store.client, store.keys.celery_prefix, queue):
        doc = json.loads(message)
        args, _kwargs, _embed = json.loads(base64.b64decode(doc["body"]))
        out.append({"task": doc["headers"]["task"], "args": repr(tuple(args))})
    return out


def test_a_step_lost_before_publish_goes_again_though_its_queue_is_busy(
    store: Store, sweeper_settings: Settings, dispatcher: Dispatcher
) -> None:
    now = time.time()
    lost = start(store, drive="auto", owe=True, now=now - 5)  # committed 5 s ago; its message never left
    busy = start(store, drive="auto", owe=True, now=now)
    dispatcher.step(busy, 1, "test")  # published now, and nobody consumes it
    counts = sweep_once(store, dispatcher, sweeper_settings, now=now + 0.5)
    assert counts["owed"] == 1
    assert [m["args"] for m in queued(store, "steps")] == [
        repr((busy, 1, "test")),
        repr((lost, 1, "sweeper")),
    ], "the lost step is published again; the waiting one is not duplicated"


def test_a_step_that_may_still_wait_behind_the_oldest_message_is_left_alone(
    store: Store, sweeper_settings: Settings, dispatcher: Dispatcher
) -> None:
    now = time.time()
    other = start(store, drive="auto", owe=True, now=now)
    dispatcher.step(other, 1, "test")
    maybe_waiting = start(store, drive="auto", owe=True, now=now - 0.5)  # within the margin of that publish
    assert sweep_once(store, dispatcher, sweeper_settings, now=now + 2)["owed"] == 0
    assert len(queued(store, "steps")) == 1
    # At the latest after lost_grace it goes again.
    counts = sweep_once(store, dispatcher, sweeper_settings, now=now + 301)
    assert counts["owed"] == 2
    assert {m["args"] for m in queued(store, "steps")[1:]} == {
        repr((other, 1, "sweeper")),
        repr((maybe_waiting, 1, "sweeper")),
    }


def test_a_queue_head_without_a_publish_time_proves_nothing(
    store: Store, sweeper_settings: Settings, dispatcher: Dispatcher
) -> None:
    now = time.time()
    start(store, drive="auto", owe=True, now=now - 5)
    dispatcher.app.send_task("something.else", args=(), queue="steps")  # published by some other program
    assert sweep_once(store, dispatcher, sweeper_settings, now=now + 0.5)["owed"] == 0


def test_an_async_call_lost_before_publish_goes_again_though_its_queue_is_busy(
    store: Store, sweeper_settings: Settings, dispatcher: Dispatcher
) -> None:
    sid, calls = waiting_on(store, ("c1", "async_t"))
    [call] = calls
    member = f"{sid} {call.field}"
    now = time.time()
    store.client.zadd(store.keys.dispatched, {member: int((now - 5) * 1000)})  # dispatched 5 s ago, never sent
    other, other_calls = waiting_on(store, ("c2", "async_t"))
    dispatcher.call(other, other_calls[0])
    counts = sweep_once(store, dispatcher, sweeper_settings, now=now + 0.5)
    assert counts["redispatched"] == 1
    assert [m["args"] for m in queued(store, "tools")] == [
        repr((other, other_calls[0].field)),
        repr((sid, call.field)),
    ]


def test_sweeps_that_leave_work_alone_leave_nothing_behind_in_redis(
    store: Store, sweeper_settings: Settings, dispatcher: Dispatcher
) -> None:
    """The sweeper looks at up to 200 entries every second while a queue is busy: looking, when it
    changes nothing (the step may still wait in its queue, or a worker runs it), writes nothing."""
    now = time.time()
    other = start(store, drive="auto", owe=True, now=now)
    dispatcher.step(other, 1, "test")
    waiting = [start(store, drive="auto", owe=True, now=now - 0.5) for _ in range(3)]
    running = start(store, drive="auto", owe=True, now=now - 5)
    store.client.set(store.keys.lease(running), "worker-a", px=60_000)
    before = keys_under(store)
    for i in range(10):
        assert sweep_once(store, dispatcher, sweeper_settings, now=now + 2 + i * 0.1)["owed"] == 0
    assert keys_under(store) == before, "each look at a waiting or running step left a key behind"
    assert set(waiting) | {running} <= set(store.client.zrange(store.keys.owed, 0, -1)), "all still owed"


def keys_under(store: Store) -> set[str]:
    return set(store.client.scan_iter(f"{store.keys.prefix}*", count=1000))


def test_after_redis_was_away_the_sweeper_takes_over_nothing_for_one_lease(
    store: Store, sweeper_settings: Settings, dispatcher: Dispatcher
) -> None:
    """A step whose worker waited a Redis outage out finds its lease lapsed (nobody could renew it):
    for one lease after Redis is back the sweeper leaves it alone, so the step can take its lease
    back; after that, a lapsed lease again means its worker died."""
    now = time.time()
    picked = start(store, drive="auto", owe=True, now=now - 5)
    begin(store, picked, "worker-a")
    store.client.delete(store.keys.lease(picked))  # lapsed during the outage
    outage = AfterOutage(lease_seconds=1.0)
    outage.unreachable(ConnectionError("refused"))
    outage.reached()
    assert not outage.may_recover(store)
    assert sweep_once(store, dispatcher, sweeper_settings, now=now, recover=outage.may_recover(store))["owed"] == 0
    assert queued(store, "steps") == []
    wait_for(lambda: outage.may_recover(store), timeout=10, what="one lease after Redis came back")
    assert sweep_once(store, dispatcher, sweeper_settings, now=now, recover=outage.may_recover(store))["owed"] == 1


def test_a_redis_that_started_less_than_a_lease_ago_gets_no_takeovers(tmp_path: Path, settings: Settings) -> None:
    """Restarted between two sweeps, Redis shows no failure to the sweeper: its uptime does."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        fresh = Store(client_for_url(server.url), replace(settings, redis_url=server.url))
        assert not AfterOutage(lease_seconds=30).may_recover(fresh)
    finally:
        server.stop(kill=True)
