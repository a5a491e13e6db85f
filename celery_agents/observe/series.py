"""The Prometheus series a worker's processes count into (contract.md, "Metrics and traces").

Imported only once `PROMETHEUS_MULTIPROC_DIR` names the worker's metrics folder (see
`observe.metrics`): prometheus-client then keeps each value in a file per process, and the
supervisor's `/metrics` sums them. Label values are bounded sets: outcomes and codes we name, the
model and tool names of the agent file (never the model's free text).
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

#: step latency buckets (seconds): a step is a model call plus inline tools
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

steps = Counter(
    "agents_steps",
    "Step tasks run, by outcome (committed, waiting, noop, stale, busy, lost, failed...).",
    ["outcome"],
    registry=None,
)
step_seconds = Histogram(
    "agents_step_seconds",
    "Wall time of one step task (model call, inline tools, commit).",
    buckets=STEP_BUCKETS,
    registry=None,
)
model_calls = Counter(
    "agents_model_calls",
    "Model calls (retries included), by the agent file's model and outcome.",
    ["model", "outcome"],
    registry=None,
)
model_tokens = Counter(
    "agents_model_tokens", "Tokens of model calls: input, output, reasoning, cached.", ["model", "kind"], registry=None
)
tool_calls = Counter(
    "agents_tool_calls",
    "Tool calls finished, by tool, disposition and outcome.",
    ["tool", "disposition", "outcome"],
    registry=None,
)
completions = Counter(
    "agents_completions",
    "Completions applied (outcome=applied) or refused (the reason's code).",
    ["outcome"],
    registry=None,
)
republished = Counter(
    "agents_republished", "Steps and calls the sweeper published again, by kind (step, call).", ["kind"], registry=None
)
lease_takeovers = Counter(
    "agents_lease_takeovers", "Steps and calls taken over after their worker's lease lapsed.", ["kind"], registry=None
)
sandbox_oom_kills = Counter(
    "agents_sandbox_oom_kills", "Processes of isolated calls the kernel killed for memory.", registry=None
)

# Series that stay at zero on a healthy fleet are served from the start, so that a dashboard's
# rate() sees their first increase.
for _kind in ("step", "call"):
    republished.labels(_kind)
    lease_takeovers.labels(_kind)
