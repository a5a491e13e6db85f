"""Scale: many paused sessions waiting on a deferred call, and what reading them costs.

    python bench/probes/scale.py [--sessions 100000] [--json]

Starts a private redis-server (or uses `AGENTS_REDIS_URL`) and creates N sessions of an agent with
one external tool, each paused (drive manual) and waiting on one deferred call: a first turn, the
model's turn asking for the call, its token. They are written by the store's own code paths
(`Store.create_session`, `begin_step`, `commit` and the same Lua scripts), with the scripts queued
on pipelines of a few hundred sessions instead of one round trip each. Reported:

- Redis memory per paused session (`INFO memory` used_memory before and after, divided by N);
- `session pending ID`, `session pending --limit 50` (a page of the global list) and
  `session list --limit 50`: in-process store calls and `agents` CLI wall times, at 1,000 sessions
  and at N, to show that none of them scans.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import os

from bench.harness import DEFER_AGENT, DEFER_PROMPT
from bench.processes import Processes, agents_env, time_cli

CHUNK = 250


class _QueuedScripts:
    """Stands in for `Store.scripts`: queues each script call on a pipeline and answers as if it had
    succeeded ("busy" for begin_step, so that the store does not parse a payload it has not got)."""

    def __init__(self, real: Any, pipe: Any) -> None:
        self.real, self.pipe = real, pipe
        self.names: list[str] = []

    def run(self, name: str, keys: list[str], args: list[Any], client: Any = None) -> Any:
        self.real.run(name, keys, args, client=self.pipe)
        self.names.append(name)
        return ["busy", "queued"] if name == "begin_step" else ["ok", 0, 0]

    def __getattr__(self, name: str) -> Any:
        """Everything else (the scripts' KEYS, say) is the real one's."""
        return getattr(self.real, name)


class SessionFactory:
    """Writes paused sessions waiting on one deferred call, `CHUNK` sessions per round trip."""

    def __init__(self, store: Any) -> None:
        from celery_agents.model import LlmTurn, ToolCall, Usage, UserQuery
        from celery_agents.runtime import SecureIds, SystemClock
        from celery_agents.scheduler import Ports, Snapshot, advance
        from celery_agents.tools.resolve import parse_agent

        self.store = store
        self.agent = parse_agent(DEFER_AGENT)
        self.query = UserQuery(text=DEFER_PROMPT)
        turn = LlmTurn(
            text=None,
            reasoning="The user wants a table; a person must confirm.",
            tool_calls=[ToolCall(id="call_0_0", name="book_table", arguments='{"city": "Paris"}')],
            usage=Usage(prompt_tokens=40, completion_tokens=12, total_tokens=52),
            model="demo/scale",
        )

        class Model:
            def complete(self, request: Any) -> Any:
                return turn

        # One session stepped for real gives the two transitions every session repeats.
        sid = store.create_session(self.agent, self.query).session_id
        ports = Ports(llm=Model(), tools=None, clock=SystemClock(), ids=SecureIds())  # type: ignore[arg-type]
        self.transitions = []
        for _ in range(2):
            begun = store.begin_step(sid, store.header(sid).version, "scale")
            loaded = begun.loaded
            assert loaded is not None, begun
            snap = Snapshot(header=loaded.header, agent=self.agent, turns=loaded.turns, calls=loaded.calls)
            t = advance(snap, ports)
            self.transitions.append((t, loaded.header))
            assert self._commit(sid, loaded.header, t).outcome == "ok"
        assert store.header(sid).state.value == "waiting"

    def _commit(self, sid: str, header: Any, t: Any, calls: Any = None) -> Any:
        from celery_agents.runtime import commit_transition

        return commit_transition(self.store, header, "scale", t, request="scale", calls=calls)

    def create(self, n: int) -> None:
        from celery_agents.store import new_session_id, new_token

        store = self.store
        (t1, h1), (t2, h2) = self.transitions
        real = store.scripts
        done = 0
        try:
            while done < n:
                pipe = store.client.pipeline(transaction=False)
                store.scripts = _QueuedScripts(real, pipe)
                for _ in range(min(CHUNK, n - done)):
                    h = store.create_session(self.agent, self.query, session_id=new_session_id())
                    sid = h.session_id
                    store.begin_step(sid, 1, "scale", "scale")
                    self._commit(sid, h1.model_copy(update={"session_id": sid}), t1)
                    store.begin_step(sid, 2, "scale", "scale")
                    calls = [c.model_copy(update={"token": new_token(sid)}) for c in t2.calls]
                    self._commit(sid, h2.model_copy(update={"session_id": sid}), t2, calls)
                names = store.scripts.names
                results = pipe.execute()
                for name, res in zip(names, results, strict=True):
                    if name != "pack_waiting" and res[0] != "ok":  # packing answers 1 (or 0)
                        raise RuntimeError(f"{name} refused while creating sessions: {res}")
                done += min(CHUNK, n - done)
        finally:
            store.scripts = real


def median_ms(fn: Any, runs: int = 15) -> float:
    fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return round(statistics.median(times), 3)


def measure(store: Any, url: str, prefix: str, cli_runs: int) -> dict[str, Any]:
    """Reading costs at the current number of sessions: in-process and through the CLI."""
    from celery_agents.client import Client

    one = store.client.zrange(store.keys.pending_all, 0, 0)[0].split(" ")[0]
    client = Client(store.settings)
    client._store = store
    env = agents_env(url, prefix)
    out = {
        "sessions": sum(store.state_counts().values()),
        "store_pending_one_ms": median_ms(lambda: store.pending_view(one)),
        "store_pending_page50_ms": median_ms(lambda: store.pending_view(limit=50)),
        "client_list50_ms": median_ms(lambda: client.list(limit=50)),
        "cli_pending_one_ms": time_cli(["session", "pending", one, "--json"], env, cli_runs)["median_ms"],
        "cli_pending_page50_ms": time_cli(["session", "pending", "--limit", "50", "--json"], env, cli_runs)[
            "median_ms"
        ],
        "cli_list50_ms": time_cli(["session", "list", "--limit", "50", "--json"], env, cli_runs)["median_ms"],
    }
    out["cli_pending_one_ms"] = round(out["cli_pending_one_ms"], 1)
    out["cli_pending_page50_ms"] = round(out["cli_pending_page50_ms"], 1)
    out["cli_list50_ms"] = round(out["cli_list50_ms"], 1)
    return out


def used_memory(client: Any) -> int:
    return int(client.info("memory")["used_memory"])


def run(n: int, cli_runs: int, config: dict[str, str] | None = None) -> dict[str, Any]:
    from celery_agents.config import Settings
    from celery_agents.store import Store, client_for_url

    prefix = f"scale{uuid.uuid4().hex[:6]}"
    with Processes() as procs:
        url = os.environ.get("AGENTS_REDIS_URL") or procs.redis_server()
        store = Store(client_for_url(url), Settings(redis_url=url, prefix=prefix))
        for name, value in (config or {}).items():
            store.client.config_set(name, value)
        factory = SessionFactory(store)
        base = used_memory(store.client)
        first = min(1000, n) - 1  # the template session counts as one
        t0 = time.perf_counter()
        factory.create(first)
        small = measure(store, url, prefix, cli_runs)
        small["used_memory_per_session_bytes"] = round((used_memory(store.client) - base) / first)
        factory.create(n - first - 1)
        elapsed = time.perf_counter() - t0
        large = measure(store, url, prefix, cli_runs)
        large["used_memory_per_session_bytes"] = round((used_memory(store.client) - base) / (n - 1))
        mem = store.client.info("memory")
        result = {
            "sessions": n,
            "create_seconds": round(elapsed, 1),
            "create_sessions_per_s": round((n - 1) / elapsed),
            "redis_used_memory_mb": round(int(mem["used_memory"]) / 2**20, 1),
            "redis_keys": store.client.dbsize(),
            "at_1000": small,
            f"at_{n}": large,
            "cli_runs": cli_runs,
            "redis_server": store.client.info("server")["redis_version"],
            "redis_config": config or {},
            "cores": os.cpu_count(),
        }
        store.client.close()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description="Many paused sessions: memory and reading costs.")
    parser.add_argument("--sessions", type=int, default=100_000)
    parser.add_argument("--cli-runs", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="CONFIG SET on the Redis first, e.g. stream-node-max-bytes=1024 (repeatable)",
    )
    args = parser.parse_args()
    config = dict(c.split("=", 1) for c in args.config)
    if args.sessions < 1001:
        parser.error("--sessions must be above 1000 (the first figures are taken at 1,000)")
    try:
        result = run(args.sessions, args.cli_runs, config)
    except KeyboardInterrupt:
        print("interrupted; every process the script started was stopped", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    n = args.sessions
    print(
        f"{n:,} paused sessions created in {result['create_seconds']} s ({result['create_sessions_per_s']:,}/s); "
        f"Redis {result['redis_used_memory_mb']} MB, {result['redis_keys']:,} keys"
    )
    print(f"  {'':34} {'1,000 sessions':>16} {f'{n:,} sessions':>16}")
    for key, label in (
        ("used_memory_per_session_bytes", "Redis memory per session (bytes)"),
        ("store_pending_one_ms", "Store.pending_view(ID) ms"),
        ("store_pending_page50_ms", "Store.pending_view(limit=50) ms"),
        ("client_list50_ms", "Client.list(limit=50) ms"),
        ("cli_pending_one_ms", "agents session pending ID ms"),
        ("cli_pending_page50_ms", "agents session pending --limit 50"),
        ("cli_list50_ms", "agents session list --limit 50 ms"),
    ):
        print(f"  {label:34} {result['at_1000'][key]:>16} {result[f'at_{n}'][key]:>16}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
