"""What the slow-model phase's calls cost alone, in a fresh process: one model call over HTTP
through litellm and one forked python tool call, as a steps process makes them.

    python bench/slow_floor.py [--calls 2000]

Starts a local model server answering at once and prints one JSON object: the CPU of one call of
the phase's agent (`LitellmPort.complete`, the tool offered, the answer a tool call) from 50
threads at a time, as a steps process waits on them, and of one call of the phase's tool forked
from its module's warm fork server, one at a time (the caller's, the server's and the call's
process's CPU). Each session of the phase makes two such model calls and one such tool call in
three steps, each step a Celery task: `bench/run.py` adds a no-op Celery task's CPU to a third of
the three calls' and reports the sum as `slow_model_cpu_floor_ms_per_step`, what a step of the
phase cannot cost less than on the machine of the run, durable or not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from bench.probes.fork_call import one_run as fork_calls
from bench.probes.http_call import _request, run_calls
from bench.processes import Processes

#: the threads a steps process's model calls come from at once, as in `bench/probes/http_call.py`
THREADS = 50


def measure(calls: int) -> dict[str, Any]:
    from celery_agents.llm import LitellmPort
    from celery_agents.llm.adapter import ensure_litellm

    ensure_litellm()
    with Processes() as procs:
        url = procs.slow_model(0.0)
        request = _request(url, tools=True)
        port = LitellmPort()
        run_calls(port, request, 200, 1)  # warm: imports, the connection, the price-map search
        model = run_calls(port, request, calls - calls % THREADS, THREADS)
    tool = fork_calls(max(calls // 4, 50))
    return {
        "slow_model_model_call_cpu_ms": model["cpu_ms_per_call"],
        "slow_model_tool_call_cpu_ms": tool["total_cpu_ms"],
        "slow_model_tool_call_parts_ms": {
            "caller": tool["caller_cpu_ms"],
            "fork_server": tool["server_cpu_ms"],
            "call_process": tool["call_process_cpu_ms"],
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    print(json.dumps(measure(args.calls)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
