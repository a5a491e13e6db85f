"""What one paused session costs in Redis memory (bench key `paused_session_bytes`).

The session is the demo's deferred booking (`harness.DEFER_AGENT`, "Please book a table in
Paris."), driven inline on the demo model until it waits on its one deferred call, as a person
would leave it. Counted:

- `MEMORY USAGE <key> SAMPLES 0` of every key of the session (its name and entry in the keyspace
  included), but the script replies kept for retries (`req:` keys: they expire within minutes);
- what its entries add to the shared indexes (its state's, `ids`, `pending`,
  `deadlines`, `expiring`), measured on copies of those indexes filled with as many entries of the
  same shape as make Redis use its large encoding (a skiplist), as it does with many sessions.

`paused_session_keys` and `paused_session_index_bytes` give the parts.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import DEFER_AGENT, DEFER_PROMPT

#: entries the index copies get first: more than `zset-max-listpack-entries` (128)
INDEX_FILL = 300


def _part(key: str) -> str:
    name = key.rsplit("}:", 1)[-1]
    return "token" if name.startswith("tok:") else name


def paused_session_bytes(url: str, prefix: str, home: Path) -> dict[str, Any]:
    from celery_agents import Client
    from celery_agents.config import Settings
    from celery_agents.tools.resolve import parse_agent

    settings = Settings(redis_url=url, prefix=prefix, home=home)
    with Client(settings, inline=True) as client:
        sid = client.start(parse_agent(DEFER_AGENT), DEFER_PROMPT).session_id
        view = client.view(sid)
        for _ in range(4):
            if view.state.value == "waiting":
                break
            view = client.step(sid)
        if view.state.value != "waiting":
            raise RuntimeError(f"the booking session did not come to wait: {view.state.value}")
        r, keys = client.store.client, client.store.keys
        parts: dict[str, int] = {}
        for key in r.scan_iter(match=f"{prefix}:s:{{{sid}}}:*", count=1000):
            if ":req:" in key:
                continue
            parts[_part(key)] = parts.get(_part(key), 0) + int(r.memory_usage(key, samples=0) or 0)
        indexes = {
            "state": keys.state_index(view.state.value),
            "ids": keys.ids,
            "pending": keys.pending_all,
            "deadlines": keys.deadlines,
            "expiring": keys.expiring,
        }
        index_bytes = {name: _entry_cost(r, key, sid, prefix) for name, key in indexes.items()}
    return {
        "paused_session_bytes": sum(parts.values()) + sum(index_bytes.values()),
        "paused_session_keys": dict(sorted(parts.items())),
        "paused_session_index_bytes": index_bytes,
        "paused_session_redis": str(r.info("server")["redis_version"]),
    }


def _entry_cost(r: Any, index: str, sid: str, prefix: str) -> int:
    """What the session's entries of the sorted set `index` add to a large one like it."""
    mine = [(m, s) for m, s in r.zrange(index, 0, -1, withscores=True) if m.split(" ", 1)[0] == sid]
    if not mine:
        return 0
    scratch = f"{prefix}:bench:index-copy"
    r.delete(scratch)
    fill = {}
    for i in range(INDEX_FILL):
        member, score = mine[i % len(mine)]
        other = secrets.token_hex(len(sid) // 2)
        fill[other + member[len(sid) :]] = score + i
    r.zadd(scratch, fill)
    before = int(r.memory_usage(scratch, samples=0) or 0)
    r.zadd(scratch, dict(mine))
    after = int(r.memory_usage(scratch, samples=0) or 0)
    r.delete(scratch)
    return after - before


def measure(url: str, prefix: str, home: Path) -> dict[str, Any]:
    """The bench keys of this phase, on the Redis at `url` under `prefix`."""
    return paused_session_bytes(url, f"{prefix}-paused", home)


def main() -> int:
    """`python bench/paused_memory.py`: the figure alone, on a private redis-server (`REDIS_SERVER`,
    else the system's), under a prefix like bench/run.py's; one JSON object."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from bench.processes import Processes

    with Processes() as procs:
        url = procs.redis_server()
        result = measure(url, f"bench{uuid.uuid4().hex[:8]}", procs.dir / "paused-home")
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
