"""`/metrics` of `agents serve`: gauges read from Redis's indexes at scrape time (one pipelined
round trip each, never a scan), so every `serve` process reports the same numbers."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from celery_agents.store import Store

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SessionCollector(Collector):
    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        sessions = GaugeMetricFamily("agents_sessions", "Sessions by stored state.", labels=["state"])
        for state, count in self.store.state_counts().items():
            sessions.add_metric([state], count)
        yield sessions
        yield GaugeMetricFamily(
            "agents_pending_calls", "Unfinished tool calls of every session.", value=self.store.pending_count()
        )


def registry_for(store: Store) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SessionCollector(store))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
