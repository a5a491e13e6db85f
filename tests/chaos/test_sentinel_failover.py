"""A Sentinel failover under load: two real workers run sessions (each: a runSync tool, a runAsync
tool, an answer; three model calls) against a primary with two replicas and three sentinels, and
the primary is SIGKILLed mid-load. The workers follow the promoted replica without a restart
(state through redis-py's Sentinel client, queues through kombu's sentinel transport); every
session completes with exactly three model calls and exactly one run of each of its tools.

What asynchronous replication may lose is bounded here by the writes' `WAIT 1` (the default on
Sentinel, AGENTS_ACK_REPLICAS): nothing a worker acted on is lost, so no session is rewound and
doctor passes. tests/chaos/test_sentinel_state.py shows the other case: a write no replica
acknowledged is lost and found rewound."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.store import client_for_url
from tests.chaos.conftest import report
from tests.chaos.counting import CountingModel
from tests.chaos.invariants import check_invariants
from tests.e2e.conftest import record_tool, runs, wait_for
from tests.support.llm_server import LlmServer
from tests.support.sentinel import SentinelSet
from tests.support.workers import Worker, stop_all, worker_env

pytestmark = pytest.mark.slow

SESSIONS = 40
MODEL_CALLS_PER_SESSION = 3


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelSet]:
    # 2 s, not the set's 1 s: under a loaded CI a just-promoted primary busy with every client
    # reconnecting once missed 1 s of pings, and the sentinels failed over a second time.
    s = SentinelSet(tmp_path / "sentinel", down_after_ms=2000).start()
    yield s
    s.stop()


def short_writes(workers: list[Worker]) -> int:
    """Writes the workers logged as short of their replicas (each a loss a failover may cause)."""
    return sum(w.log.read_text().count("replica(s) acknowledged a write") for w in workers if w.log)


def lost_writes(workers: list[Worker], store: Any) -> str:
    """What a failure of the exact counts comes with: the writes that stood without a replica and
    the sessions found rewound (what asynchronous replication lost, and who noticed)."""
    rewound = store.rewound_sessions(limit=5)
    return (
        f"{short_writes(workers)} write(s) short of their replicas in the worker logs; "
        f"{rewound.count} session(s) recorded rewound, e.g. {rewound.sessions}"
    )


def test_every_session_completes_once_through_a_failover_under_load(
    sentinels: SentinelSet, prefix: str, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    model = CountingModel(delay=0.05)  # many steps in flight at the kill
    scenario = llm_server.scenario([model])
    log = tmp_path / "effects.jsonl"
    path = write_agent(
        {
            "slug": "failover-load",
            "model": f"openai/{scenario}",
            "apiBase": llm_server.url,
            "tools": [record_tool("effect_sync", log), record_tool("effect_async", log)],
            "toolCallPolicy": {"default": "runSync", "rules": [{"tool": "effect_async", "disposition": "runAsync"}]},
        }
    )
    url = sentinels.url()
    env = worker_env(url, prefix, AGENTS_LEASE_SECONDS="10", AGENTS_OWED_GRACE="1", AGENTS_SWEEP_INTERVAL="0.2")
    workers = [
        Worker(env, concurrency=2, log=tmp_path / f"worker{i}.log", name=f"s{i}-{prefix}@sentinel").start()
        for i in range(2)
    ]
    admin = client_for_url(url)
    settings = Settings(redis_url=url, prefix=prefix, home=tmp_path / "home")
    try:
        for w in workers:
            w.wait_ready(admin, prefix)
        with Client(settings, inline=False) as client:
            store = client.store
            sids = [client.start(path, f"session {i}", run=True, wait=False).session_id for i in range(SESSIONS)]
            completed = store.keys.state_index("completed")
            # Mid-load: a third of the model calls made, most sessions between two steps.
            wait_for(lambda: model.total >= SESSIONS, timeout=120, what="a third of the model calls")
            done_at_kill = int(store.client.zcard(completed))
            old = sentinels.kill_master()
            killed = time.monotonic()
            promoted = sentinels.wait_failover(old.port)
            failover_s = time.monotonic() - killed
            wait_for(
                lambda: int(store.client.zcard(completed)) > done_at_kill, timeout=120, what="a session to complete"
            )
            progress_s = time.monotonic() - killed
            wait_for(
                lambda: int(store.client.zcard(completed)) >= SESSIONS, timeout=300, what="every session to complete"
            )
            all_done_s = time.monotonic() - killed

            for sid in sids:
                check_invariants(store, sid)
                h = store.header(sid)
                # model, runSync tool, model, runAsync dispatched, its result folded in and the model
                assert h.steps == 5 and (h.spent.model_calls, h.spent.tool_calls) == (3, 2)
            expected = Counter({f"session {i}": MODEL_CALLS_PER_SESSION for i in range(SESSIONS)})
            assert model.per_session == expected, lost_writes(workers, store)
            for tool in ("effect_sync", "effect_async"):
                started = runs(log, tool, phase="start")
                assert len(started) == SESSIONS, f"{tool} ran {len(started)} times for {SESSIONS} sessions"
                assert len({r["key"] for r in started}) == SESSIONS
            doctor = client.doctor()
            (rewound,) = [c for c in doctor["checks"] if c["name"] == "rewound sessions"]
            assert rewound["ok"], rewound["detail"]
            assert doctor["owed_steps"] == 0 and doctor["pending_calls"] == 0
    finally:
        stop_all(workers)
        admin.close()
    short = short_writes(workers)
    report(
        "sentinel failover under load",
        sessions=SESSIONS,
        completed_at_kill=done_at_kill,
        model_calls=model.total,
        tool_runs=len(runs(log, phase="start")),
        promoted=promoted != old.port,
        failover_s=round(failover_s, 2),
        first_completion_after_kill_s=round(progress_s, 2),
        all_completed_after_kill_s=round(all_done_s, 2),
        writes_short_of_replicas=short,
    )
