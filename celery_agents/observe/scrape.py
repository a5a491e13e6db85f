"""The supervisor's `/metrics`: the worker's histogram plus the fleet's counters and the gauges of
what waits, read from Redis (state) and the broker (queue depths) when Prometheus scrapes."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from celery_agents.config import Settings
from celery_agents.observe.metrics import MetricsServer, WaitingCollector, limit_families
from celery_agents.store import Store, client_for_url, state_url
from celery_agents.store.counters import CounterKey, read_counters
from celery_agents.store.gauges import Backlog, read_backlog
from celery_agents.tasks.config import QUEUES
from celery_agents.tasks.queues import QueueProbe


def serve_worker_metrics(host: str, port: int, path: Path, settings: Settings) -> MetricsServer:
    store = Store(client_for_url(state_url(settings)), settings)  # its own connections: scrapes are a thread
    probe = QueueProbe(settings, store.queue_lists())
    lock = threading.Lock()  # scrapes may come at once; the probe keeps one broker connection

    def backlog() -> Backlog:
        return read_backlog(store.client, store.keys)

    def depths() -> dict[str, int | None]:
        with lock:
            return {name: head.depth for name, head in probe.heads(QUEUES).items()}

    def counters() -> dict[CounterKey, float]:
        return read_counters(store.client, store.keys)

    def limits() -> list[Any]:
        return limit_families(store.limit_usages(), store.pauses(), store.server_time())

    return MetricsServer(host, port, path, WaitingCollector(backlog, depths, counters, limits))
