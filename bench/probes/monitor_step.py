"""List every Redis command that steps issue inside `agents worker`, with MONITOR.

    python bench/probes/monitor_step.py [--steps N] [--workers N]

Starts a private redis-server and one `agents worker`, warms it up, then records MONITOR while N
one-step sessions (the bench agent: the demo model, no tools) are published and completed, and
prints each command (commands run inside Lua scripts included, marked `lua`) with its count per
step: the list behind `redis_commands_per_step` in `bench/run.py`.
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
import uuid
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import redis

from bench.harness import Agents, served, wait_until
from bench.processes import Processes


def _name(line: str) -> str:
    """`1700000000.123 [0 127.0.0.1:1234] "EVALSHA" "abc" ...` → `evalsha` (`lua` marked)."""
    source = line.split("[", 1)[1].split("]", 1)[0]
    words = line.split('"')
    cmd = words[1].lower() if len(words) > 1 else "?"
    if cmd in ("evalsha", "eval", "fcall"):
        return cmd
    return f"{cmd} (lua)" if " lua" in source else cmd


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    with Processes() as procs:
        url = procs.redis_server()
        prefix = f"mon{uuid.uuid4().hex[:6]}"
        agents = Agents(url, prefix)
        with served(procs, agents, args.workers, "mon"):
            for sid in agents.create(3, agent=agents.step_agent, text="Hello"):
                agents.step_roundtrip(sid)
            sids = agents.create(args.steps, agent=agents.step_agent, text="Hello")
            keys = agents.store.keys
            before = agents.client.zcard(keys.state_index("completed"))
            counts: collections.Counter[str] = collections.Counter()
            stop = threading.Event()
            conn = redis.Redis.from_url(url, decode_responses=True).connection_pool.get_connection()
            conn.send_command("MONITOR")
            conn.read_response()

            def record() -> None:
                while not stop.is_set():
                    line = conn.read_response()
                    counts[_name(str(line))] += 1

            t = threading.Thread(target=record, daemon=True)
            t.start()
            time.sleep(0.2)
            poll = redis.Redis.from_url(url)
            counts.clear()
            for sid in sids:
                agents.dispatcher.step(sid, 1, "bench")
            wait_until(lambda: poll.zcard(keys.state_index("completed")) - before >= args.steps, 120, "steps")
            time.sleep(0.5)
            stop.set()
            snapshot = dict(counts)
    for k in ("zcard",):
        snapshot.pop(k, None)
    total = sum(snapshot.values())
    for cmd, n in sorted(snapshot.items(), key=lambda kv: -kv[1]):
        print(f"{n / args.steps:8.2f}  {cmd}")
    print(f"{total / args.steps:8.2f}  total (as INFO commandstats counts them: each EVALSHA and the commands it runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
