"""The benchmark's `slow_model` phase: many sessions in flight against a model that answers in 1 s.

N sessions (an agent whose model, served by `bench/slow_model.py`, first asks for one runSync
python tool call, then answers) are created in auto drive and their first steps published back to
back to one `agents worker` started as a user starts it. Each session takes three steps (model
call, the tool, model call). Measured: the wall time from the first publish until every session
has completed, steps per second, the worker tree's CPU per step (its processes' user + system
time over that window ÷ 3N), the worker tree's peak resident memory (summed RSS sampled every
0.2 s, shared pages counted once per process; PSS every second) and the most model requests the
server held at once.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from typing import Any

from bench.harness import Agents, publish_and_wait, served
from bench.processes import Processes, tree_cpu_seconds, tree_pss_mb, tree_rss_mb

DELAY_S = 1.0


def slow_agent(url: str) -> dict[str, Any]:
    return {
        "slug": "bench-slow",
        "model": "openai/slow",
        "apiBase": url,
        "tools": [
            {
                "name": "lookup",
                "description": "Look something up.",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                "python": "bench.slow_model:lookup",
            }
        ],
    }


class PeakRss:
    """The largest resident memory of a process tree (summed RSS, and PSS), sampled on a thread.

    RSS every 0.2 s, PSS every second and once more at the end: reading `smaps_rollup` walks every
    page of a process (~30 ms of CPU for the worker tree here), which at 5 samples a second took
    15 % of a core from the phase it measures."""

    PSS_EVERY = 5

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self.peak_pss = pid, 0.0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        tick = 0
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, tree_rss_mb(self.pid))
            tick += 1
            if tick % self.PSS_EVERY == 0:
                self.peak_pss = max(self.peak_pss, tree_pss_mb(self.pid))
        self.peak_pss = max(self.peak_pss, tree_pss_mb(self.pid))

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def bench_slow_model(procs: Processes, url: str, prefix: str, step_processes: int, n: int) -> dict[str, Any]:
    from celery_agents.tools.resolve import parse_agent

    model_url = procs.slow_model(DELAY_S)
    prefix = f"{prefix}slow"
    bench = Agents(url, prefix, main="bench_slow")
    store, k = bench.store, bench.store.keys
    agent = parse_agent(slow_agent(model_url))
    with served(procs, bench, step_processes, "slow") as worker:
        sids = bench.create(n, agent=agent, text="go", drive="auto", owe=True)
        cpu0 = tree_cpu_seconds(worker.pid)
        with PeakRss(worker.pid) as rss:
            wall = publish_and_wait(store, bench.dispatcher, sids, 600, "slow-model")
        cpu = tree_cpu_seconds(worker.pid) - cpu0
        failed = store.client.zcard(k.state_index("failed"))
        if failed:
            raise RuntimeError(f"{failed} slow-model sessions failed")
        with urllib.request.urlopen(model_url + "/stats", timeout=10) as reply:
            stats = json.loads(reply.read())
    return {
        "slow_model_sessions": n,
        "slow_model_wall_s": round(wall, 3),
        "slow_model_steps_per_s": 3 * n / wall,
        "slow_model_worker_cpu_ms_per_step": round(cpu * 1000 / (3 * n), 3),
        "slow_model_peak_rss_mb": round(rss.peak, 1),
        "slow_model_peak_pss_mb": round(rss.peak_pss, 1),
        "slow_model_max_in_flight": stats["max_in_flight"],
        "slow_model_requests": stats["answered"],
        "slow_model_delay_s": DELAY_S,
    }
