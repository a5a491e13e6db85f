"""What the lease's local deadline costs: lease renewals per second, for several margins.

    python bench/probes/lease_margin.py [--holders 200] [--lease 3] [--seconds 15] [--busy 0,4] [--json]

A step trusts its lease until its last renewal's start + the lease - the margin (a third of the
lease: runtime/lease.py `MARGIN`), and past that renews it itself before its next model call, tool
call or commit. The process's renewal thread renews every lease every third of a lease whatever the
margin, so the margin costs renewals only when a step finds its deadline passed: this script holds
`--holders` leases, each in its own thread checking `holds()` every 0-50 ms as a busy step would,
for `--seconds`, with `--busy` threads spinning Python alongside (a loaded steps process: they
contend for the GIL with the renewal thread), and counts the renewals the thread sent and those
the steps sent themselves. Private redis-server on a free port.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.processes import Processes
from celery_agents.config import Settings
from celery_agents.runtime import lease as lease_module
from celery_agents.store import Store, client_for_url
from celery_agents.store.records import LeaseRef, Renewal

MARGINS = (0.0, 1 / 3, 1 / 2, 2 / 3)


class CountedStore(Store):
    """Counts the leases renewed, by the renewal thread or by the steps themselves."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lock = threading.Lock()
        self.by_thread = self.by_steps = self.round_trips = 0

    def renew_leases(self, held: list[LeaseRef]) -> list[Renewal]:
        with self.lock:
            self.round_trips += 1
            if threading.current_thread().name == "lease-renewer":
                self.by_thread += len(held)
            else:
                self.by_steps += len(held)
        return super().renew_leases(held)


def run(url: str, margin: float, holders: int, lease: float, seconds: float, busy: int) -> dict[str, Any]:
    lease_module.MARGIN = margin
    prefix = f"margin{int(margin * 1000)}b{busy}"
    store = CountedStore(client_for_url(url), Settings(redis_url=url, prefix=prefix, lease_seconds=lease))
    stop = threading.Event()
    lost = []

    def hold(i: int) -> None:
        key, owner = store.keys.lease(f"s{i:04d}"), f"owner{i}"
        asked = time.monotonic()
        store.client.set(key, owner, px=int(lease * 1000))
        with lease_module.LeaseKeeper(store, key, owner, taken_at=asked) as keeper:
            while not stop.wait(random.uniform(0, 0.05)):
                if not keeper.holds():
                    lost.append(i)
                    return

    def spin() -> None:
        while not stop.is_set():
            sum(range(2000))

    threads = [threading.Thread(target=hold, args=(i,), daemon=True) for i in range(holders)]
    threads += [threading.Thread(target=spin, daemon=True) for _ in range(busy)]
    for t in threads:
        t.start()
    time.sleep(lease)  # every holder started and renewed once: count from here
    with store.lock:
        base = (store.by_thread, store.by_steps, store.round_trips)
    time.sleep(seconds)
    with store.lock:
        counts = (store.by_thread - base[0], store.by_steps - base[1], store.round_trips - base[2])
    stop.set()
    for t in threads:
        t.join()
    return {
        "margin": round(margin, 3),
        "busy_threads": busy,
        "renewals_per_s_by_thread": round(counts[0] / seconds, 1),
        "renewals_per_s_by_steps": round(counts[1] / seconds, 1),
        "round_trips_per_s": round(counts[2] / seconds, 1),
        "lost": len(lost),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--holders", type=int, default=200)
    parser.add_argument("--lease", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--busy", default="0,4", help="busy threads per run (comma-separated)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    with Processes() as procs:
        url = procs.redis_server()
        for busy in (int(b) for b in args.busy.split(",")):
            for margin in MARGINS:
                rows.append(run(url, margin, args.holders, args.lease, args.seconds, busy))
                if not args.json:
                    print(rows[-1], file=sys.stderr)
    result = {"holders": args.holders, "lease_s": args.lease, "seconds": args.seconds, "runs": rows}
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
