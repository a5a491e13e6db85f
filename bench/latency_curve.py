"""A step's round trip against the naive Celery loop's, for model calls of several latencies.

    python bench/latency_curve.py [--delays 0,5,20] [--steps 300] [--workers N] [--json]

`bench/run.py` compares the two with the offline demo model, which answers in ~1 ms: there, the
two Redis round trips a durable step makes (lease and read, commit) are a large share of the whole.
This script puts both behind the same local OpenAI-compatible server (`bench/slow_model.py`)
answering after each delay, so that the model call goes over HTTP as it does with a provider, and
reports for each delay both round trips' p50, their difference (what durability adds) and their
ratio. Same Redis (private, on a free port), same worker count, same pool, one step at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from bench.processes import Processes, agents_env, wait_heartbeat
from celery_agents.tasks.supervisor import default_step_processes


def naive_p50(procs: Processes, url: str, prefix: str, workers: int, model_url: str, steps: int) -> float:
    """The naive loop's round trip p50 (ms): publish → its `RPUSH` seen, one step at a time."""
    from bench.run import NaiveLoop, percentile, roundtrips

    env = agents_env(url, prefix, BENCH_NAIVE_MODEL="openai/slow", BENCH_NAIVE_API_BASE=model_url)
    with NaiveLoop(procs, url, prefix, workers, env, "curve") as loop:
        rtts = roundtrips(loop.send, loop.client, loop.key, steps, "a naive step")
    return percentile(rtts[steps // 10 :], 50)


def agents_p50(procs: Processes, url: str, prefix: str, workers: int, model_url: str, steps: int) -> float:
    """celery-agents' step round trip p50 (ms): `Dispatcher.step` → `step_committed` seen."""
    from bench.run import Agents, percentile
    from celery_agents.model import parse_agent

    agents = Agents(url, prefix)
    agent = parse_agent({"slug": "curve", "model": "openai/slow", "apiBase": model_url})
    name = f"agents-{prefix}@curve"
    worker = procs.agents_worker(agents_env(url, prefix), workers, name)
    try:
        wait_heartbeat(agents.client, prefix, name, worker)
        sids = agents.create(steps, agent=agent, text="Hello")
        rtts = [agents.step_roundtrip(sid) for sid in sids]
    finally:
        procs.stop(worker, name)
        agents.close()
    return percentile(rtts[steps // 10 :], 50)


def measure(procs: Processes, url: str, prefix: str, workers: int, delay_ms: float, steps: int) -> dict[str, float]:
    """Both round trips' p50 behind one local model server answering after `delay_ms`."""
    model_url = procs.slow_model(delay_ms / 1000)
    server = procs.procs[-1][1]
    try:
        naive = naive_p50(procs, url, prefix + "n", workers, model_url, steps)
        ours = agents_p50(procs, url, prefix + "a", workers, model_url, steps)
    finally:
        procs.stop(server, "slow-model")
    return {
        "model_delay_ms": delay_ms,
        "naive_step_p50_ms": round(naive, 3),
        "step_p50_ms": round(ours, 3),
        "durability_ms": round(ours - naive, 3),
        "step_latency_vs_naive": round(ours / naive, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delays", default="0,5,20", help="model latencies to measure at (ms, comma-separated)")
    parser.add_argument(
        "--steps", type=int, default=300, help="steps timed per side and delay (the first tenth warms up)"
    )
    parser.add_argument("--workers", type=int, default=0, help="step processes (default: as bench/run.py)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    workers = args.workers or default_step_processes()
    rows: list[dict[str, Any]] = []
    with Processes() as procs:
        url = procs.redis_server()
        for delay_ms in (float(d) for d in args.delays.split(",")):
            prefix = f"curve{uuid.uuid4().hex[:6]}"
            rows.append(measure(procs, url, prefix, workers, delay_ms, args.steps))
    if args.json:
        print(json.dumps({"workers": workers, "load": os.getloadavg()[0], "rows": rows}))
        return 0
    print(f"{workers} step processes; load {os.getloadavg()[0]:.1f}")
    print(f"{'model delay':>12} {'naive p50':>10} {'step p50':>10} {'added':>8} {'ratio':>7}")
    for r in rows:
        print(
            f"{r['model_delay_ms']:>9.0f} ms {r['naive_step_p50_ms']:>7.2f} ms {r['step_p50_ms']:>7.2f} ms"
            f" {r['durability_ms']:>5.2f} ms {r['step_latency_vs_naive']:>7.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
