"""What one call of the offline demo model through litellm costs, alone, in a fresh process.

    python bench/model_call.py [--calls N]

Prints one JSON object: the wall time of `LitellmPort.complete` for the bench agent (p50), and the
CPU per call of the whole process, litellm's background logging thread included. Every step of the
benchmark makes exactly one such call, so these bound what any step can cost: a step's round trip
is at least a Celery round trip plus one call, and its CPU at least a no-op task's plus one call.
`bench/run.py` runs this and reports the bounds next to the measured ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def measure(calls: int) -> dict[str, float]:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from celery_agents.llm import LitellmPort
    from celery_agents.llm.adapter import ensure_litellm
    from celery_agents.scheduler.ports import LlmRequest
    from celery_agents.tools.resolve import parse_agent

    ensure_litellm()
    agent = parse_agent({"slug": "bench", "model": "demo/bench"})
    request = LlmRequest(agent=agent, messages=[{"role": "user", "content": "Hello"}], tools=[])
    port = LitellmPort()
    for _ in range(100):
        port.complete(request)
    time.sleep(0.2)  # the warm-up's background logging is done
    walls = []
    cpu0 = time.process_time()
    for _ in range(calls):
        t = time.perf_counter()
        port.complete(request)
        walls.append((time.perf_counter() - t) * 1000)
    # litellm logs each call on a background thread: let it finish, so that its CPU is counted
    # (an idle process spends next to nothing meanwhile).
    time.sleep(0.5)
    cpu_ms = (time.process_time() - cpu0) * 1000 / calls
    walls.sort()
    return {
        "model_call_wall_p50_ms": round(walls[len(walls) // 2], 3),
        "model_call_cpu_ms": round(cpu_ms, 3),
        "model_call_samples": calls,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args()
    print(json.dumps(measure(args.calls)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
