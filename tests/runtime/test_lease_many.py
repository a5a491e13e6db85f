"""One renewal thread per process keeps 300 leases alive at once, each held by its own thread as
the steps of a threads-pool worker hold theirs, for several times their length — also when every
request to Redis is late (a loaded or distant server): the renewals go in one round trip, not one
each."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator

import pytest

from celery_agents.runtime.lease import LeaseKeeper
from celery_agents.store import Store, client_for_url
from tests.support.proxy import TcpProxy
from tests.support.redis_server import RedisServer

HELD = 300
#: a first renewal is due a third of a lease after the holder took it: under a full suite on two
#: slow cores (the proxy below forwards in this process's threads) a 2 s lease was once seen to
#: lapse before it, so the leases here are 4 s (the default is 30 s)
LEASE_S = 4.0
#: 300 renewals one after another at this latency take 6 s, longer than a lease
LATENCY_S = 0.02


def hold_many(store: Store) -> tuple[set[str], list[LeaseKeeper]]:
    store = Store(store.client, dataclasses.replace(store.settings, lease_seconds=LEASE_S))
    keys = [store.keys.lease(f"s{i:04d}") for i in range(HELD)]
    stop = threading.Event()
    keepers: list[LeaseKeeper] = []
    #: when each holder started, took its lease and began renewing it (monotonic seconds)
    marks: dict[str, list[float]] = {"started": [], "taken": [], "renewing": []}
    holding = threading.Semaphore(0)

    errors: list[BaseException] = []

    def hold(i: int) -> None:
        marks["started"].append(time.monotonic())
        # As a step does: take the lease, then keep it while working.
        try:
            assert store.client.set(keys[i], f"owner{i}", px=int(LEASE_S * 1000))
        except BaseException as e:
            errors.append(e)
            raise
        marks["taken"].append(time.monotonic())
        with LeaseKeeper(store, keys[i], f"owner{i}") as keeper:
            keepers.append(keeper)
            marks["renewing"].append(time.monotonic())
            holding.release()
            stop.wait()

    threads = [threading.Thread(target=hold, args=(i,), daemon=True) for i in range(HELD)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    try:
        deadline = t0 + 120
        for _ in range(HELD):
            if not holding.acquire(timeout=max(0.0, deadline - time.monotonic())):
                stages = ", ".join(f"{len(v)} {k} (last at {max(v, default=t0) - t0:.1f} s)" for k, v in marks.items())
                raise AssertionError(f"of {HELD} holders after {time.monotonic() - t0:.0f} s: {stages}; {errors[:3]}")
        lapsed: set[str] = set()
        deadline = time.monotonic() + 3.5 * LEASE_S  # three and a half lease lengths
        while time.monotonic() < deadline:
            pipe = store.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            lapsed |= {k for k, alive in zip(keys, pipe.execute(), strict=True) if not alive}
            time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join()
    finally:
        stop.set()
    return lapsed, keepers


def test_three_hundred_leases_held_at_once_never_lapse(store: Store) -> None:
    lapsed, keepers = hold_many(store)
    assert not lapsed, f"{len(lapsed)} of {HELD} leases lapsed while held"
    assert not any(k.lost for k in keepers)


@pytest.fixture
def slow_store(redis_server: RedisServer, store: Store) -> Iterator[Store]:
    with TcpProxy(redis_server.port, latency=LATENCY_S) as proxy:
        client = client_for_url(proxy.url)
        yield Store(client, dataclasses.replace(store.settings, redis_url=proxy.url))
        client.close()


def test_three_hundred_leases_survive_a_slow_redis(slow_store: Store) -> None:
    lapsed, keepers = hold_many(slow_store)
    assert not lapsed, f"{len(lapsed)} of {HELD} leases lapsed while held ({LATENCY_S * 1000:.0f} ms per request)"
    assert not any(k.lost for k in keepers)
