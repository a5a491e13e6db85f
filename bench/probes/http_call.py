"""What one model call over HTTP through litellm costs in CPU, in one process, as a steps process
makes it: `LitellmPort.complete` for an agent with `apiBase` pointing at `bench/slow_model.py`
(answering at once), from `--threads` threads at a time, each waiting on the process's model loop.

    python bench/probes/http_call.py [--calls 2000] [--threads 1,50] [--profile out.txt] [--tools]

Prints one JSON object: for each thread count, the process's CPU per call (every thread counted,
the model loop's included) and the wall time per call. With `--profile FILE` py-spy records the last
thread count's calls there (raw collapsed stacks of the thread holding the GIL; `bench/probes/stacks.py`
sums them). `--tools` offers the call one tool,
so that the answer is a tool call, as the slow-model phase's first call is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from bench.in_flight import slow_agent
from bench.processes import Processes


def _request(url: str, tools: bool) -> Any:
    from celery_agents.scheduler.ports import LlmRequest
    from celery_agents.tools.resolve import parse_agent

    spec = slow_agent(url)
    if not tools:
        spec.pop("tools")
    agent = parse_agent(spec)
    offered = [{"type": "function", "function": {"name": t.name, "parameters": t.parameters}} for t in agent.tools]
    return LlmRequest(agent=agent, messages=[{"role": "user", "content": "go"}], tools=offered)


def run_calls(port: Any, request: Any, calls: int, threads: int) -> dict[str, float]:
    """`calls` calls, split over `threads` threads; CPU and wall time per call (ms)."""
    per = calls // threads
    barrier = threading.Barrier(threads + 1)

    def worker() -> None:
        barrier.wait()
        for _ in range(per):
            port.complete(request)

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    cpu0, t0 = time.process_time(), time.perf_counter()
    barrier.wait()
    for t in pool:
        t.join()
    n = per * threads
    return {
        "cpu_ms_per_call": round((time.process_time() - cpu0) * 1000 / n, 3),
        "wall_ms_per_call": round((time.perf_counter() - t0) * 1000 / n, 3),
    }


def _py_spy(out: str) -> subprocess.Popen[bytes]:
    """py-spy recording this process's thread holding the GIL, as raw collapsed stacks."""
    cmd = [shutil.which("py-spy") or "py-spy", "record", "--format", "raw", "-r", "500", "--gil", "--nonblocking"]
    spy = subprocess.Popen([*cmd, "-o", out, "-p", str(os.getpid())], stdout=subprocess.DEVNULL)
    time.sleep(1.0)
    return spy


def measure(calls: int, threads: list[int], tools: bool, profile: str) -> dict[str, Any]:
    from celery_agents.llm import LitellmPort
    from celery_agents.llm.adapter import ensure_litellm

    ensure_litellm()
    out: dict[str, Any] = {"calls": calls, "tools": tools}
    with Processes() as procs:
        url = procs.slow_model(0.0)
        request = _request(url, tools)
        port = LitellmPort()
        run_calls(port, request, 200, 1)  # warm: imports, the connection, the price-map search
        for i, n in enumerate(threads):
            if profile and i == len(threads) - 1:
                spy = _py_spy(profile)
                try:
                    out[f"threads_{n}"] = run_calls(port, request, calls, n)
                finally:
                    spy.send_signal(signal.SIGINT)
                    spy.wait(timeout=60)
            else:
                out[f"threads_{n}"] = run_calls(port, request, calls, n)
    out["load_1m"] = os.getloadavg()[0]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--threads", default="1,50")
    parser.add_argument("--tools", action="store_true")
    parser.add_argument("--profile", default="")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    print(json.dumps(measure(args.calls, threads, args.tools, args.profile)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
