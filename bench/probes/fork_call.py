"""What one runSync python tool call costs in CPU, in one process, as a steps process makes it:
`fork_call` of the slow-model phase's tool (`bench.slow_model:lookup`) from its module's warm fork
server, supervised until it ends, one call at a time.

    python bench/probes/fork_call.py [--calls 500] [--runs 3]

Prints one JSON object per run: per call, the wall time and the CPU of the caller (this process),
of the fork server (its own, forking) and of the call's processes (reaped by the server: their
Python, their copy-on-write faults and their exit), and the server's resident memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from celery_agents.tools.forkserver import fork_call, warm_servers
from celery_agents.tools.process import supervise
from celery_agents.tools.python_call import child_request

SPEC = "bench.slow_model:lookup"
ROOT = str(Path(__file__).resolve().parents[2])


def _cpu(pid: int) -> tuple[float, float]:
    """(own, reaped children's) CPU seconds of `pid` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, (int(fields[13]) + int(fields[14])) / tick


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def call() -> None:
    forked = fork_call(SPEC, [ROOT], {}, "/tmp", 30.0)
    request = child_request(SPEC, {"q": "x"}, [ROOT], 100_000, env={}, cwd="/tmp")
    result = supervise(forked, request, time.monotonic(), timeout=30.0, output_cap=100_000)
    if result.exit_status != 0:
        raise RuntimeError(f"the call failed: {result.stderr[-500:]!r}")


def one_run(calls: int) -> dict[str, float]:
    for _ in range(20):  # the server started, the function's argument model made
        call()
    server = next(s.pid for s in warm_servers() if s.pid)
    own0, kids0 = _cpu(server)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(calls):
        call()
    cpu1, wall1 = time.process_time(), time.perf_counter()
    own1, kids1 = _cpu(server)
    per = 1000 / calls
    return {
        "calls": calls,
        "wall_ms": round((wall1 - wall0) * per, 3),
        "caller_cpu_ms": round((cpu1 - cpu0) * per, 3),
        "server_cpu_ms": round((own1 - own0) * per, 3),
        "call_process_cpu_ms": round((kids1 - kids0) * per, 3),
        "total_cpu_ms": round((cpu1 - cpu0 + own1 - own0 + kids1 - kids0) * per, 3),
        "server_rss_mb": round(_rss_mb(server), 1),
        "load_1m": round(os.getloadavg()[0], 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    for _ in range(args.runs):
        print(json.dumps(one_run(args.calls)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
