"""`/metrics` of `agents serve`: read from Redis at scrape time (one pipelined round trip each,
never a scan), so every `serve` process reports the same numbers as every worker: sessions by
state, the backlog gauges and the fleet's counters (docs/observability.md)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from celery_agents.client import Client
from celery_agents.observe.metrics import backlog_families, counter_families, limit_families

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SessionCollector(Collector):
    def __init__(self, client: Client) -> None:
        self.client = client

    def collect(self) -> Iterator[GaugeMetricFamily]:
        figures = self.client.fleet_figures()
        sessions = GaugeMetricFamily("agents_sessions", "Sessions by stored state.", labels=["state"])
        for state, count in figures.states.items():
            sessions.add_metric([state], count)
        yield sessions
        # The same gauges of what waits and the same counters as every worker's /metrics (observe/metrics.py).
        yield from backlog_families(figures.backlog)
        yield from counter_families(figures.counters)
        yield from limit_families(figures.limits, figures.pauses, figures.now)


def registry_for(client: Client) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SessionCollector(client))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
