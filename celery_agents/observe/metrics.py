"""Prometheus metrics of one `agents worker`: counting in every process, serving from the supervisor.

The worker is several processes (supervisor, threads-pool steps processes, a prefork tools pool):
prometheus-client's multiprocess mode keeps each process's values in files of one folder per
worker, emptied when the worker starts, and `/metrics` (on 127.0.0.1 only) sums them. Gauges of
what waits (queues, unfinished calls, owed steps, unapplied completions) are read from Redis at
scrape time, by the supervisor alone, so they never depend on which process last wrote them.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from celery_agents.store.gauges import Backlog

log = logging.getLogger("celery_agents.metrics")

#: prometheus-client's own variable: set before it is imported, it selects multiprocess mode
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: ours: tells the worker's processes to count (Settings.metrics_dir)
METRICS_DIR_ENV = "AGENTS_METRICS_DIR"


def worker_folder(root: Path, worker_name: str) -> Path:
    """The folder of one worker's metric files under `root`: its name made a plain file name, so
    that no name (`..`, `a/../b`) reaches outside `root` — the folder is emptied at start."""
    return root / ("worker-" + re.sub(r"[^A-Za-z0-9_.@-]", "_", worker_name)[:200])


def prepare_dir(path: Path) -> None:
    """An empty folder for this worker's metric files (a restarted worker starts from zero), named
    in the environment its Celery worker processes inherit."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True, mode=0o700)
    os.environ[MULTIPROC_ENV] = str(path)
    os.environ[METRICS_DIR_ENV] = str(path)


def open_series(path: Path) -> ModuleType:
    """This process's series, counting into `path` (prometheus-client must not be imported before)."""
    os.environ.setdefault(MULTIPROC_ENV, str(path))
    import prometheus_client.values

    value_class = getattr(prometheus_client.values.ValueClass, "__name__", "")
    if os.environ[MULTIPROC_ENV] != str(path) or value_class != "MmapedValue":
        # Imported earlier without the folder: count in this process's memory, which /metrics never sees.
        log.warning("prometheus-client was set up before %s: this process's metrics are not served", path)
    from celery_agents.observe import series

    return series


def bounded(name: str, known: Callable[[str], bool], limit: int = 64) -> str:
    """A label value from a closed set: `name` when `known`, else `_other`."""
    return name[:limit] if known(name) else "_other"


def backlog_families(b: Backlog) -> list[Any]:
    """The gauges of what waits in Redis: one definition for every `/metrics` (worker and serve)."""
    from prometheus_client.core import GaugeMetricFamily

    calls = GaugeMetricFamily(
        "agents_pending_calls",
        "Unfinished tool calls: defer (waiting for a completion), dispatched (runAsync/runIsolated "
        "published), other (ready or running in a step).",
        labels=["disposition"],
    )
    calls.add_metric(["defer"], b.deferred_calls)
    calls.add_metric(["dispatched"], b.dispatched_calls)
    calls.add_metric(["other"], max(0, b.pending_calls - b.deferred_calls - b.dispatched_calls))
    return [
        calls,
        GaugeMetricFamily(
            "agents_oldest_pending_call_seconds", "Age of the oldest unfinished call.", value=b.oldest_pending_seconds
        ),
        GaugeMetricFamily("agents_owed_steps", "Sessions owed a step (the outbox).", value=b.owed_steps),
        GaugeMetricFamily(
            "agents_completions_waiting", "Completions stream entries not applied yet.", value=b.completions_waiting
        ),
        GaugeMetricFamily(
            "agents_completions_lag_seconds",
            "Age of the oldest completions stream entry not applied yet.",
            value=b.completions_lag_seconds,
        ),
    ]


class WaitingCollector:
    """Gauges of what waits, read from Redis and the broker when Prometheus scrapes."""

    def __init__(self, backlog: Callable[[], Backlog], queue_depths: Callable[[], dict[str, int | None]]) -> None:
        self.backlog, self.queue_depths = backlog, queue_depths

    def describe(self) -> list[Any]:
        return []  # read on each scrape: nothing to check at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        try:
            b = self.backlog()
            depths = self.queue_depths()
        except Exception as exc:  # Redis away: the counters still serve; `agents_redis_up` says why not these
            log.warning("cannot read the backlog for /metrics: %s", exc)
            yield GaugeMetricFamily("agents_redis_up", "1 when the last scrape could read Redis.", value=0)
            return
        yield GaugeMetricFamily("agents_redis_up", "1 when the last scrape could read Redis.", value=1)
        queue = GaugeMetricFamily("agents_queue_depth", "Messages waiting in each Celery queue.", labels=["queue"])
        for name, depth in sorted(depths.items()):
            if depth is not None:
                queue.add_metric([name], depth)
        yield queue
        yield from backlog_families(b)


class MetricsServer:
    """`/metrics` on host:port: the sum of every process's files plus the gauges of what waits."""

    def __init__(self, host: str, port: int, path: Path, waiting: WaitingCollector) -> None:
        from prometheus_client import CollectorRegistry, start_http_server
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(path))  # type: ignore[no-untyped-call]
        registry.register(waiting)
        self.server, self.thread = start_http_server(port, addr=host, registry=registry)
        self.port = self.server.server_port

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
