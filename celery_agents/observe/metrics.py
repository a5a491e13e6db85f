"""Prometheus metrics of one `agents worker`, served by its supervisor (on 127.0.0.1 only).

The counters are the fleet's, read from Redis at scrape time (`counter_families`: the scripts that
record the work count it there, store/counters.py), and so are the gauges of what waits (queues,
unfinished calls, owed steps, unapplied completions): every worker and every `agents serve` serve
the same numbers, whichever process did the work. The one series of the worker's own is the step
latency histogram: the worker is several processes (supervisor, threads-pool steps processes, a
prefork tools pool), and prometheus-client's multiprocess mode keeps each process's values in
files of one folder per worker, emptied when the worker starts, which `/metrics` sums.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from celery_agents.model.admission import LimitUsage, Pause
from celery_agents.store.gauges import GATES_READ, Backlog

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


#: the fleet's counters (store/counters.py) by series: help text and label names. Every series a
#: script or a `Tally` counts is here (tests/store/test_lua_contract.py checks the scripts').
FLEET_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "steps": (
        "Steps run, by outcome (committed, waiting, noop, stale, busy, ended, missing, lost, failed, error, "
        "throttled).",
        ("outcome",),
    ),
    "model_calls": ("Model calls (retries included), by the agent file's model and outcome.", ("model", "outcome")),
    "model_tokens": ("Tokens of model calls: input, output, reasoning, cached.", ("model", "kind")),
    "tool_calls": (
        "Tool calls finished, by tool, disposition and outcome (completed, failed; expired for defer).",
        ("tool", "disposition", "outcome"),
    ),
    "completions": (
        "Completions applied (outcome=applied; CLI, API and stream) or stream entries refused (the reason's code).",
        ("outcome",),
    ),
    "republished": ("Steps and calls the sweeper published again, by kind (step, call).", ("kind",)),
    "lease_takeovers": ("Steps and calls taken over after their worker's lease lapsed.", ("kind",)),
    "calls_refused": (
        "Dispatched calls a worker refused to run: the stored record disagreed with the signed spec, by lane.",
        ("lane",),
    ),
    "sandbox_oom_kills": ("Processes of isolated calls the kernel killed for memory.", ()),
    "spend": (
        "What sessions spent, by kind: tokens of model calls, cost (USD, litellm's pricing where it has one).",
        ("kind",),
    ),
    "model_calls_throttled": (
        "Model calls a fleet limit made wait (each time its step was put back), by the limit's KEY, or by the "
        "model a provider's 429 paused.",
        ("key",),
    ),
}

# Series that stay at zero on a healthy fleet are served from the start, so that a dashboard's
# rate() sees their first increase.
_ZERO: tuple[tuple[str, ...], ...] = (
    *((series, kind) for series in ("republished", "lease_takeovers") for kind in ("step", "call")),
    ("calls_refused", "runAsync"),
    ("calls_refused", "runIsolated"),
    ("sandbox_oom_kills",),
    ("spend", "tokens"),
    ("spend", "cost"),
)


def counter_families(counts: Mapping[tuple[str, ...], float]) -> list[Any]:
    """The fleet's counters as Prometheus counters (`agents_<series>_total`); a field of a series
    or shape this release does not know (written by another release) is left out."""
    from prometheus_client.core import CounterMetricFamily

    families = {
        series: CounterMetricFamily(f"agents_{series}", text, labels=list(labels))
        for series, (text, labels) in FLEET_COUNTERS.items()
    }
    seen: dict[tuple[str, ...], float] = {key: 0 for key in _ZERO} | dict(counts)
    for key, value in sorted(seen.items()):
        spec = FLEET_COUNTERS.get(key[0])
        if spec is not None and len(key) - 1 == len(spec[1]):
            families[key[0]].add_metric(list(key[1:]), value)
    return list(families.values())


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
    gates = GaugeMetricFamily(
        "agents_gates_pending",
        "Approval gates waiting for a decision, by time left before their deadline (<1h, <1d, >=1d), "
        f"among the {GATES_READ} nearest deadlines.",
        labels=["left"],
    )
    for left, count in b.gates_by_left.items():
        gates.add_metric([left], count)
    return [
        calls,
        gates,
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


def limit_families(usages: Sequence[LimitUsage], pauses: Sequence[Pause], now: float) -> list[Any]:
    """The gauges of the fleet's limits on model calls: each limit, its use this minute, calls in
    flight and waiting, how far ahead its rate is booked; the models a 429 paused (`now`: Redis's
    clock, seconds)."""
    from prometheus_client.core import GaugeMetricFamily

    limit = GaugeMetricFamily(
        "agents_model_limit", "Fleet limits on model calls, by KEY and kind.", labels=["key", "kind"]
    )
    used = GaugeMetricFamily(
        "agents_model_limit_used",
        "Model calls (kind=requests) and tokens (kind=tokens) counted under each KEY in the current minute.",
        labels=["key", "kind"],
    )
    in_flight = GaugeMetricFamily(
        "agents_model_limit_in_flight", "Model calls holding a slot of a concurrency limit.", labels=["key"]
    )
    waiting = GaugeMetricFamily(
        "agents_model_limit_waiting", "Steps waiting for a slot of a concurrency limit.", labels=["key"]
    )
    booked = GaugeMetricFamily(
        "agents_model_limit_booked_seconds",
        "How long a model call asking now would wait for the KEY's rate limits.",
        labels=["key"],
    )
    for u in usages:
        for kind in ("rpm", "tpm", "concurrency"):
            value = getattr(u.limit, kind)
            if value is not None:
                limit.add_metric([u.key, kind], value)
        used.add_metric([u.key, "requests"], u.requests_this_minute)
        used.add_metric([u.key, "tokens"], u.tokens_this_minute)
        if u.limit.concurrency is not None:
            in_flight.add_metric([u.key], u.in_flight)
            waiting.add_metric([u.key], u.waiting)
        booked.add_metric([u.key], u.booked_seconds)
    paused = GaugeMetricFamily(
        "agents_model_paused_seconds", "Seconds left of a model's pause after a provider's 429.", labels=["model"]
    )
    for p in pauses:
        paused.add_metric([p.model], max(0.0, p.until - now))
    return [limit, used, in_flight, waiting, booked, paused]


class WaitingCollector:
    """The fleet's counters and the gauges of what waits, read from Redis and the broker when
    Prometheus scrapes."""

    def __init__(
        self,
        backlog: Callable[[], Backlog],
        queue_depths: Callable[[], dict[str, int | None]],
        counters: Callable[[], Mapping[tuple[str, ...], float]],
        limits: Callable[[], list[Any]] | None = None,
    ) -> None:
        self.backlog, self.queue_depths, self.counters = backlog, queue_depths, counters
        #: the gauges of the fleet's limits (`limit_families`), read at each scrape
        self.limits = limits

    def describe(self) -> list[Any]:
        return []  # read on each scrape: nothing to check at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        try:
            b = self.backlog()
            depths = self.queue_depths()
            counts = self.counters()
            limits = self.limits() if self.limits is not None else []
        except Exception as exc:  # Redis away: the histogram still serves; `agents_redis_up` says why not these
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
        yield from counter_families(counts)
        yield from limits


class MetricsServer:
    """`/metrics` on host:port: the sum of every process's files (the histogram) plus the fleet's
    counters and the gauges of what waits."""

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
