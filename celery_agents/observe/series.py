"""The Prometheus series a worker's processes keep themselves (docs/reference.md, "Metrics and traces").

Only the step latency histogram: every counter is the fleet's, kept in Redis by the scripts that
record the work (store/counters.py) and served from there (`observe.metrics.counter_families`).
Imported only once `PROMETHEUS_MULTIPROC_DIR` names the worker's metrics folder (see
`observe.metrics`): prometheus-client then keeps each value in a file per process, and the
supervisor's `/metrics` sums them.
"""

from __future__ import annotations

from prometheus_client import Histogram

#: step latency buckets (seconds): a step is a model call plus inline tools
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

step_seconds = Histogram(
    "agents_step_seconds",
    "Wall time of one step task (model call, inline tools, commit), in this worker's processes.",
    buckets=STEP_BUCKETS,
    registry=None,
)
