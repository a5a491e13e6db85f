"""One renewal thread per process keeps 300 leases alive at once, each held by its own thread as
the steps of a threads-pool worker hold theirs, for several times their length."""

from __future__ import annotations

import dataclasses
import threading
import time

from celery_agents.runtime.lease import LeaseKeeper
from celery_agents.store import Store

HELD = 300
LEASE_S = 2.0


def test_three_hundred_leases_held_at_once_never_lapse(store: Store) -> None:
    store = Store(store.client, dataclasses.replace(store.settings, lease_seconds=LEASE_S))
    keys = [store.keys.lease(f"s{i:04d}") for i in range(HELD)]
    for i, key in enumerate(keys):
        assert store.client.set(key, f"owner{i}", px=int(LEASE_S * 1000))
    start, stop = threading.Barrier(HELD + 1, timeout=60), threading.Event()
    keepers: list[LeaseKeeper] = []

    def hold(i: int) -> None:
        with LeaseKeeper(store, keys[i], f"owner{i}") as keeper:
            keepers.append(keeper)
            start.wait()
            stop.wait()

    threads = [threading.Thread(target=hold, args=(i,)) for i in range(HELD)]
    for t in threads:
        t.start()
    start.wait()
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
    assert not lapsed, f"{len(lapsed)} of {HELD} leases lapsed while held"
    assert not any(k.lost for k in keepers)
