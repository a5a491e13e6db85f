"""A step's round trip against the naive Celery loop's, for model calls of several latencies.

    python bench/latency_curve.py [--delays 0,5,20] [--steps 300] [--workers N] [--json]

`bench/run.py` compares the two with the offline demo model, which answers in ~1 ms: there, the
two Redis round trips a durable step makes (lease and read, commit) are a large share of the whole.
This script puts both behind the same local OpenAI-compatible server (`bench/slow_model.py`)
answering after each delay, so that the model call goes over HTTP as it does with a provider, and
reports for each delay both round trips' p50, their difference (what durability adds) and their
ratio. Same Redis (private, on a free port), same worker count, same pool, one step at a time, the
two loops' steps alternating.
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

from bench.harness import Agents, NaiveLoop, default_step_processes, percentile, roundtrips, served
from bench.processes import Processes, agents_env


def measure(procs: Processes, url: str, prefix: str, workers: int, delay_ms: float, steps: int) -> dict[str, float]:
    """Both round trips' p50 behind one local model server answering after `delay_ms`: both loops
    run at once, and their steps alternate one at a time (a naive step, a durable step, ...), so
    that whatever the machine does meanwhile (the phase before winding down, other work) weighs on
    both alike; the first tenth of each warms up."""
    from celery_agents.tools.resolve import parse_agent

    model_url = procs.slow_model(delay_ms / 1000)
    server = procs.procs[-1][1]
    env = agents_env(url, prefix + "n", BENCH_NAIVE_MODEL="openai/slow", BENCH_NAIVE_API_BASE=model_url)
    agents = Agents(url, prefix + "a")
    agent = parse_agent({"slug": "curve", "model": "openai/slow", "apiBase": model_url})
    naive_rtts: list[float] = []
    rtts: list[float] = []
    try:
        naive_loop = NaiveLoop(procs, url, prefix + "n", workers, env, "curve")
        with naive_loop as loop, served(procs, agents, workers, "curve"):
            for sid in agents.create(steps, agent=agent, text="Hello"):
                naive_rtts += roundtrips(loop.send, loop.client, loop.key, 1, "a naive step")
                rtts.append(agents.step_roundtrip(sid))
    finally:
        procs.stop(server, "slow-model")
    naive = percentile(naive_rtts[steps // 10 :], 50)
    ours = percentile(rtts[steps // 10 :], 50)
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
