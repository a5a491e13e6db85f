"""Steps per second on one primary, alone and under Sentinel, with and without writes waiting for a
replica; and what sessions cost in memory (for docs/deployment.md's sizing).

    python bench/probes/replicated.py [--steps 2000] [--json]

Starts a primary, two replicas and three sentinels (redis-server processes on free ports, AOF
off: the primary's own persistence is not what is compared), then for each setup an `agents
worker` (one steps process per core) and publishes `--steps` one-step sessions (the demo model
answers at once, as in bench/run.py's throughput phase), timed until all completed; then the step
round trip p50 over 200 sessions one at a time. Setups:

- `single`: `redis://` to the primary (its replicas follow it, nothing waits for them);
- `sentinel`: `redis+sentinel://`, every write waiting for one replica (`WAIT 1`, the default);
- `sentinel_no_wait`: the same with `AGENTS_ACK_REPLICAS=0`.

Memory: `paused_session_bytes` (bench/paused_memory.py) and the same count for a session whose one
step completed, each as sessions per GiB.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import redis

from bench.harness import Agents, wait_until
from bench.paused_memory import paused_session_bytes
from bench.processes import Processes, agents_env, free_port, own_cpu_seconds, redis_server_binary, wait_heartbeat

MASTER = "bench-main"


def start_set(procs: Processes) -> tuple[int, int, list[int]]:
    """A primary, two replicas and three sentinels (quorum 2): the primary's port and pid, the
    sentinels' ports."""
    binary = redis_server_binary()
    ports = [free_port() for _ in range(3)]
    pids = []
    for i, port in enumerate(ports):
        data = procs.dir / f"redis{i}"
        data.mkdir(exist_ok=True)
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(data)]
        if i:
            args += ["--replicaof", "127.0.0.1", str(ports[0])]
        pids.append(procs.start(f"redis{i}", args).pid)
    for port in ports:
        _wait(lambda p=port: redis.Redis(port=p, socket_connect_timeout=0.2).ping(), "redis-server")
    for port in ports[1:]:
        _wait(lambda p=port: redis.Redis(port=p).info("replication")["master_link_status"] == "up", "a replica")
    sentinels = [free_port() for _ in range(3)]
    for port in sentinels:
        folder = procs.dir / f"sentinel{port}"
        folder.mkdir()
        conf = folder / "sentinel.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {folder}\nsentinel monitor {MASTER} 127.0.0.1 {ports[0]} 2\n"
            f"sentinel down-after-milliseconds {MASTER} 5000\n"
        )
        procs.start(f"sentinel{port}", [binary, str(conf), "--sentinel"])

    def seen() -> bool:
        for p in sentinels:
            state = redis.Redis(port=p, decode_responses=True).sentinel_master(MASTER)
            if int(state["num-other-sentinels"]) < 2 or int(state["num-slaves"]) < 2:
                return False
        return True

    _wait(seen, "the sentinels", timeout=60)
    return ports[0], pids[0], sentinels


def _wait(check: Any, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.RedisError):
            if check():
                return
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def measure_setup(procs: Processes, url: str, name: str, steps: int, primary: int, **env: str) -> dict[str, Any]:
    prefix = f"repl-{name}"
    agents = Agents(url, prefix)
    worker_name = f"{prefix}@bench"
    worker = procs.agents_worker(agents_env(url, prefix, **env), None, worker_name)
    try:
        wait_heartbeat(agents.client, prefix, worker_name, worker)
        keys = agents.store.keys
        for sid in agents.create(30, agent=agents.step_agent, text="Hello"):
            agents.step_roundtrip(sid)
        rtts = [agents.step_roundtrip(s) for s in agents.create(200, agent=agents.step_agent, text="Hello")]
        sids = agents.create(steps, agent=agents.step_agent, text="Hello")
        done = agents.client.zcard(keys.state_index("completed"))
        cpu0 = own_cpu_seconds(primary)
        t0 = time.perf_counter()
        for sid in sids:
            agents.dispatcher.step(sid, 1, "bench")
        wait_until(lambda: agents.client.zcard(keys.state_index("completed")) - done >= steps, 600, f"{steps} steps")
        elapsed = time.perf_counter() - t0
        redis_ms = (own_cpu_seconds(primary) - cpu0) * 1000 / steps
    finally:
        procs.stop(worker, worker_name)
        agents.close()
    return {
        "steps_per_s": round(steps / elapsed, 1),
        "step_latency_p50_ms": round(statistics.median(rtts), 2),
        # The primary's CPU per step (its polling by the bench included): one core's worth of it
        # is the most steps per second one primary can commit, whatever the workers.
        "primary_cpu_ms_per_step": round(redis_ms, 3),
        "steps_per_s_per_primary_core": round(1000 / redis_ms) if redis_ms else None,
    }


def completed_session_bytes(url: str, prefix: str) -> int:
    """MEMORY USAGE of a one-step session that completed (its keys; its two index entries are
    counted as the paused session's are, about 130 bytes each)."""
    from bench.harness import STEP_AGENT
    from celery_agents import Client
    from celery_agents.config import Settings
    from celery_agents.tools.resolve import parse_agent

    with Client(Settings(redis_url=url, prefix=prefix), inline=True) as client:
        sid = client.start(parse_agent(STEP_AGENT), "Hello").session_id
        assert client.step(sid).state.value == "completed"
        r = client.store.client
        return sum(
            int(r.memory_usage(k, samples=0) or 0)
            for k in r.scan_iter(match=f"{prefix}:s:{{{sid}}}:*")
            if ":req:" not in k
        )


def run(steps: int) -> dict[str, Any]:
    with Processes() as procs:
        primary, pid, sentinels = start_set(procs)
        direct = f"redis://127.0.0.1:{primary}/0"
        sentinel = "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in sentinels) + f"/{MASTER}/0"
        out: dict[str, Any] = {
            "redis_server": redis.Redis(port=primary).info("server")["redis_version"],
            "cores": os.cpu_count(),
            "steps": steps,
        }
        out["single"] = measure_setup(procs, direct, "single", steps, pid)
        out["sentinel"] = measure_setup(procs, sentinel, "sentinel", steps, pid)
        out["sentinel_no_wait"] = measure_setup(procs, sentinel, "nowait", steps, pid, AGENTS_ACK_REPLICAS="0")
        paused = paused_session_bytes(direct, "repl-memory", procs.dir / "home")
        completed = completed_session_bytes(direct, "repl-memory") + 2 * 130
        out["paused_session_bytes"] = paused["paused_session_bytes"]
        out["paused_sessions_per_gib"] = 2**30 // paused["paused_session_bytes"]
        out["completed_session_bytes"] = completed
        out["completed_sessions_per_gib"] = 2**30 // completed
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description="Steps/s alone and under Sentinel; memory per session.")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.steps)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
