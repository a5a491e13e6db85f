"""DBOS, the durable-execution library users compare celery-agents with, making the same model call
(the bench agent's demo model through the same `LitellmPort` as the naive loop) as one
`@DBOS.step` inside a `@DBOS.workflow`, checkpointed to PostgreSQL.

One DBOS executor per process, started as many times as `agents worker` runs steps processes:

    python bench/dbos_loop.py --url postgresql://…/db --executor dbos0 --report FILE [--latency M]

Each launches DBOS on the run's system database, registers the queue `bench` (`worker_concurrency`
workflows at a time per process, polled every `polling_interval_sec`), warms litellm up as
`agents worker` does, and writes `--report` once it serves the queue. With `--latency M` it first
runs M workflows one at a time with `DBOS.start_workflow` → `handle.get_result()` in its own
process (the library's own path, no queue) and puts their wall times in the report. It runs until
SIGTERM. `bench/dbos_phase.py` starts these and measures from the benchmark's process.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dbos import DBOS, DBOSConfig

APP = "celery-agents-bench"
VERSION = "bench"  # every process the same, so that any of them dequeues what the bench enqueues
QUEUE = "bench"
TOPIC = "completion"
WAITING_EVENT = "waiting"
MODEL = "demo/bench"
# Per process: as many workflows at once as `agents worker` runs step threads would drown the
# system database's connection pool (20) in waits; see docs/performance.md ("What bounds them").
WORKER_CONCURRENCY = 20
POLLING_INTERVAL_SEC = 0.01

_state: dict[str, Any] = {}


def _model() -> tuple[Any, Any]:
    if "port" not in _state:
        from celery_agents.llm import LitellmPort
        from celery_agents.scheduler.ports import LlmRequest
        from celery_agents.tools.resolve import parse_agent

        agent = parse_agent({"slug": "bench", "model": MODEL})
        _state["port"] = LitellmPort()
        _state["request"] = LlmRequest(agent=agent, messages=[{"role": "user", "content": "Hello"}], tools=[])
    return _state["port"], _state["request"]


@DBOS.step()
def model_step() -> None:
    port, request = _model()
    port.complete(request)


@DBOS.workflow()
def one_step() -> None:
    model_step()


@DBOS.step()
def step_after_signal() -> float:
    """The step that follows the signal: the wall clock when it started, then the model call."""
    started = time.time()
    port, request = _model()
    port.complete(request)
    return started


@DBOS.workflow()
def resume_after_signal() -> float:
    DBOS.set_event(WAITING_EVENT, True)
    DBOS.recv(TOPIC, timeout_seconds=300)
    return step_after_signal()


def launch(url: str, executor: str, concurrency: int, polling: float) -> None:
    config: DBOSConfig = {
        "name": APP,
        "system_database_url": url,
        "application_version": VERSION,
        "executor_id": executor,
        "log_level": "WARNING",
    }
    DBOS(config=config)
    DBOS.launch()
    DBOS.register_queue(QUEUE, worker_concurrency=concurrency, polling_interval_sec=polling)


def latency(samples: int, warmup: int) -> list[float]:
    """Wall times (ms) of `samples` one-step workflows run one at a time in this process."""
    for _ in range(warmup):
        DBOS.start_workflow(one_step).get_result()
    walls = []
    for _ in range(samples):
        t0 = time.perf_counter()
        DBOS.start_workflow(one_step).get_result()
        walls.append((time.perf_counter() - t0) * 1000)
    return walls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the run's DBOS system database")
    parser.add_argument("--executor", required=True)
    parser.add_argument("--report", required=True, type=Path, help="written (JSON) once the queue is served")
    parser.add_argument("--concurrency", type=int, default=WORKER_CONCURRENCY)
    parser.add_argument("--polling", type=float, default=POLLING_INTERVAL_SEC)
    parser.add_argument("--latency", type=int, default=0, help="workflows timed one at a time first")
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from celery_agents.llm.adapter import warm_up

    warm_up()  # as `agents worker` does: litellm imported and one call made before the first step
    launch(args.url, args.executor, args.concurrency, args.polling)
    report: dict[str, Any] = {"pid": os.getpid(), "concurrency": args.concurrency, "polling_sec": args.polling}
    if args.latency:
        report["latency_ms"] = latency(args.latency, args.warmup)
    tmp = args.report.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    tmp.rename(args.report)
    stop.wait()
    DBOS.destroy(workflow_completion_timeout_sec=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
