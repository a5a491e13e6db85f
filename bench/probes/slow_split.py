"""Where the slow-model phase's CPU goes: `bench/in_flight.py`'s run, with CPU split by process.

    python bench/probes/slow_split.py [--sessions 300] [--runs 1] [--py-spy stacks.txt [--gil]] [-- extra worker flags]

Starts a private redis-server, `bench/slow_model.py` and one `agents worker` (as `bench/run.py`
starts it: `--step-processes` the cores, `--loglevel WARNING`, unless `--loglevel` is given), runs
N sessions of the slow-model agent (model call, runSync python tool, model call) and prints the
wall time and the CPU (user + system, `/proc`) each process spent between the first publish and
the last completion: the supervisor, the zygote, each steps process, the tools worker (its pool
processes included), the model server, redis-server and this process (publishing and polling).
With `--py-spy FILE` the steps processes are recorded (raw collapsed stacks) during the window.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness import Agents, publish_and_wait
from bench.in_flight import DELAY_S, PeakRss, slow_agent
from bench.processes import Processes, _stat, agents_env, tree_cpu_seconds, tree_pids, wait_heartbeat


def _children(pid: int) -> list[int]:
    return [p for p in tree_pids(pid) if p != pid and (f := _stat(p)) is not None and int(f[1]) == pid]


def roles(supervisor: int) -> dict[str, int]:
    """The worker tree by role: the zygotes are the supervisor's children, the Celery workers
    theirs; the tools worker is the one with pool processes of its own."""
    out = {"supervisor": supervisor}
    steps = 0
    for i, zygote in enumerate(sorted(_children(supervisor))):
        out[f"zygote{i}"] = zygote
        for child in sorted(_children(zygote)):
            if _children(child):
                out["tools"] = child
            else:
                out[f"steps{steps}"] = child
                steps += 1
    return out


def own(pid: int) -> float:
    f = _stat(pid)
    return sum(int(x) for x in f[11:13]) / os.sysconf("SC_CLK_TCK") if f else 0.0


def snapshot(parts: dict[str, int], model_pid: int, redis_pid: int) -> dict[str, float]:
    now = {name: (tree_cpu_seconds(pid) if name == "tools" else own(pid)) for name, pid in parts.items()}
    now["model_server"] = own(model_pid)
    now["redis"] = own(redis_pid)
    now["bench"] = time.process_time()
    return now


def one_run(n: int, extra: list[str], pyspy_out: str, rate: int, gil: bool = False) -> dict[str, Any]:
    from celery_agents.tools.resolve import parse_agent

    with Processes() as procs:
        url = procs.redis_server()
        assert procs.redis_pid
        model_url = procs.slow_model(DELAY_S)
        model_pid = next(p.pid for name, p in procs.procs if name == "slow-model")
        prefix = f"split{uuid.uuid4().hex[:6]}"
        bench = Agents(url, prefix, main="bench_split")
        store = bench.store
        agent = parse_agent(slow_agent(model_url))
        name = f"split-{prefix}@bench"
        args = [sys.executable, "-m", "celery_agents.cli", "worker", "--queues", "steps,tools,isolated"]
        args += ["--name", name]
        if "--loglevel" not in extra:
            args += ["--loglevel", "WARNING"]
        if "--step-processes" not in extra:
            args += ["--step-processes", str(len(os.sched_getaffinity(0)))]
        worker = procs.start("worker", [*args, *extra], agents_env(url, prefix))
        k = store.keys
        wait_heartbeat(store.client, prefix, name, worker)
        parts = roles(worker.pid)
        sids = bench.create(n, agent=agent, text="go", drive="auto", owe=True)
        spy = None
        if pyspy_out:
            steps = [str(pid) for role, pid in parts.items() if role.startswith("steps")]
            cmd = [shutil.which("py-spy") or "py-spy", "record", "--format", "raw", "-r", str(rate), "--nonblocking"]
            cmd += ["--gil"] if gil else []
            spy = [
                subprocess.Popen([*cmd, "-o", f"{pyspy_out}.{pid}", "-p", pid], stdout=subprocess.DEVNULL)
                for pid in steps
            ]
            time.sleep(1.0)
        before = snapshot(parts, model_pid, procs.redis_pid)
        with PeakRss(worker.pid) as rss:
            wall = publish_and_wait(store, bench.dispatcher, sids, 3600, "split")
        after = snapshot(parts, model_pid, procs.redis_pid)
        if spy:
            for p in spy:
                p.send_signal(signal.SIGINT)
            for p in spy:
                p.wait(timeout=60)
        failed = store.client.zcard(k.state_index("failed"))
        with urllib.request.urlopen(model_url + "/stats", timeout=10) as reply:
            stats = json.loads(reply.read())
        procs.stop(worker, "worker")
        bench.close()
    cpu = {name: round(after[name] - before[name], 2) for name in after}
    tree = sum(v for name, v in cpu.items() if name not in ("model_server", "redis", "bench"))
    total = sum(cpu.values())
    return {
        "sessions": n,
        "failed": failed,
        "wall_s": round(wall, 2),
        "cpu_s": cpu,
        "worker_tree_cpu_s": round(tree, 2),
        "total_cpu_s": round(total, 2),
        "worker_tree_cpu_ms_per_step": round(tree * 1000 / (3 * n), 2),
        "total_cpu_ms_per_step": round(total * 1000 / (3 * n), 2),
        "peak_rss_mb": round(rss.peak, 1),
        "peak_pss_mb": round(rss.peak_pss, 1),
        "max_in_flight": stats["max_in_flight"],
        "load_1m": round(os.getloadavg()[0], 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=300)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--py-spy", default="", help="record the steps processes into FILE[.pid]")
    parser.add_argument("--rate", type=int, default=100)
    parser.add_argument("--gil", action="store_true", help="with --py-spy: sample only the thread holding the GIL")
    parser.add_argument("extra", nargs="*", help="extra `agents worker` flags (after --)")
    args = parser.parse_args()
    for i in range(args.runs):
        out = f"{args.py_spy}.{i}" if args.py_spy and args.runs > 1 else args.py_spy
        print(json.dumps(one_run(args.sessions, args.extra, out, args.rate, args.gil)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
