"""`/metrics` of `agents serve`: gauges read from Redis's indexes at scrape time (one pipelined
round trip each, never a scan), so every `serve` process reports the same numbers: sessions by
state, and the backlog gauges the workers serve too (docs/observability.md)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from celery_agents.observe.metrics import backlog_families
from celery_agents.store import Store
from celery_agents.store.gauges import read_backlog

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SessionCollector(Collector):
    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        sessions = GaugeMetricFamily("agents_sessions", "Sessions by stored state.", labels=["state"])
        for state, count in self.store.state_counts().items():
            sessions.add_metric([state], count)
        yield sessions
        # The same gauges of what waits as every worker's /metrics (observe/metrics.py).
        yield from backlog_families(read_backlog(self.store.client, self.store.keys))


def registry_for(store: Store) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SessionCollector(store))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
