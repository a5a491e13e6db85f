"""The supervisor's `/metrics`: the worker's counters plus the gauges of what waits, read from
Redis (state) and the broker (queue depths) when Prometheus scrapes."""

from __future__ import annotations

import threading
from pathlib import Path

from celery_agents.config import Settings
from celery_agents.observe.metrics import MetricsServer, WaitingCollector
from celery_agents.store import Store, client_for_url, state_url
from celery_agents.store.gauges import Backlog, read_backlog
from celery_agents.tasks.config import QUEUES
from celery_agents.tasks.queues import QueueProbe


def serve_worker_metrics(host: str, port: int, path: Path, settings: Settings) -> MetricsServer:
    store = Store(client_for_url(state_url(settings)), settings)  # its own connections: scrapes are a thread
    probe = QueueProbe(settings, store.client)
    lock = threading.Lock()  # scrapes may come at once; the probe keeps one broker connection

    def backlog() -> Backlog:
        return read_backlog(store.client, store.keys)

    def depths() -> dict[str, int | None]:
        with lock:
            return {name: head.depth for name, head in probe.heads(QUEUES).items()}

    return MetricsServer(host, port, path, WaitingCollector(backlog, depths))
