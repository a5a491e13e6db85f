"""Failures of a Redis Cluster holding session state (3 primaries, a replica each, started here),
the queues on a Redis of their own (`AGENTS_BROKER_URL`), real workers running sessions of three
model calls and two tools (runSync, runAsync):

- slots holding running sessions are migrated back and forth (`redis-cli --cluster reshard`) while
  they run: redis-py's cluster client follows MOVED and ASK; every session completes with exactly
  three model calls and one run of each tool;
- the primary serving running sessions is SIGKILLed: its replica is promoted, the workers follow
  it without a restart and load their scripts there; every session completes, each tool run once;
- a worker is SIGKILLed mid-step: a fresh one finishes the session, nothing done twice that was
  committed."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.errors import RedisUnavailable
from celery_agents.model.slots import id_in_slot, shard_slots, tag_slot
from celery_agents.store import client_for_url
from tests.chaos.conftest import CHAOS_ENV, report
from tests.chaos.counting import CountingModel
from tests.chaos.invariants import check_invariants
from tests.e2e.conftest import record_tool, runs, wait_for
from tests.support.cluster import RedisCluster
from tests.support.llm_server import LlmServer, Reply, calls, text
from tests.support.redis_server import RedisServer
from tests.support.workers import Worker, stop_all, worker_env

pytestmark = pytest.mark.slow

SESSIONS = 16
MODEL_CALLS_PER_SESSION = 3


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = RedisServer(tmp_path_factory.mktemp("broker")).start()
    yield server.url
    server.stop(kill=True)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    c = RedisCluster(tmp_path / "cluster").start()
    yield c
    c.stop()


class Run:
    """Workers on the cluster and a client, for one test."""

    def __init__(self, cluster: RedisCluster, broker: str, tmp_path: Path, llm_server: LlmServer, delay: float):
        self.prefix = f"cf{uuid.uuid4().hex[:8]}"
        self.cluster, self.tmp_path = cluster, tmp_path
        self.model = CountingModel(delay)
        self.scenario = llm_server.scenario([self.model])
        self.log = tmp_path / "effects.jsonl"
        self.agent = {
            "slug": "cluster-chaos",
            "model": f"openai/{self.scenario}",
            "apiBase": llm_server.url,
            "tools": [record_tool("effect_sync", self.log), record_tool("effect_async", self.log)],
            "toolCallPolicy": {"default": "runSync", "rules": [{"tool": "effect_async", "disposition": "runAsync"}]},
        }
        self.env = worker_env(cluster.url(), self.prefix, tmp_path / "home", AGENTS_BROKER_URL=broker, **CHAOS_ENV)
        self.settings = Settings(
            redis_url=cluster.url(),
            broker_url=broker,
            prefix=self.prefix,
            home=tmp_path / "home",
            lease_seconds=2,
            owed_grace=1,
            sweep_interval=0.2,
        )
        self.workers: list[Worker] = []
        self.admin = client_for_url(cluster.url())

    def worker(self, **env: str) -> Worker:
        w = Worker(
            {**self.env, **env},
            concurrency=2,
            log=self.tmp_path / f"worker{len(self.workers)}.log",
            name=f"w{len(self.workers)}-{self.prefix}@cluster",
        ).start()
        self.workers.append(w)
        w.wait_ready(self.admin, self.prefix)
        return w

    def check_all(self, client: Client, sids: list[str]) -> None:
        store = client.store
        for sid in sids:
            check_invariants(store, sid)
            h = store.header(sid)
            # model, runSync tool, model, runAsync dispatched, its result folded in and the model
            assert h.steps == 5 and (h.spent.model_calls, h.spent.tool_calls) == (3, 2), (sid, h)
        prompts = {f"session {i}" for i in range(len(sids))}
        assert self.model.per_session == Counter(dict.fromkeys(prompts, MODEL_CALLS_PER_SESSION))
        for tool in ("effect_sync", "effect_async"):
            started = runs(self.log, tool, phase="start")
            assert len(started) == len(sids), f"{tool} ran {len(started)} times for {len(sids)} sessions"
            assert len({r["key"] for r in started}) == len(sids)

    def close(self) -> None:
        stop_all(self.workers)
        self.admin.close()


def start_sessions(client: Client, path: Path, slots: list[int]) -> list[str]:
    """SESSIONS sessions, the first half in `slots` (round robin), the rest where ids fall."""
    keys = client.store.keys
    made = keys.new_session_id
    sids = []
    for i in range(SESSIONS):
        if i < SESSIONS // 2:
            slot = slots[i % len(slots)]
            keys.new_session_id = lambda beside=None, slot=slot: id_in_slot(uuid.uuid4().hex[:27], slot)  # type: ignore[method-assign]
        else:
            keys.new_session_id = made  # type: ignore[method-assign]
        sids.append(client.start(path, f"session {i}", run=True, wait=False).session_id)
    keys.new_session_id = made  # type: ignore[method-assign]
    return sids


def completed(client: Client) -> int:
    """Sessions completed, over every shard; 0 while a slot moving again and again keeps the
    test's own read redirected (it does not wait out an outage as a worker does)."""
    try:
        return sum(int(client.store.client.zcard(k.state_index("completed"))) for k in client.store.keys.all_shards())
    except RedisUnavailable:
        return 0


def test_slots_migrated_while_sessions_run_lose_nothing(
    cluster: RedisCluster, broker: str, tmp_path: Path, llm_server: LlmServer, write_agent: Any
) -> None:
    """First `redis-cli --cluster reshard` moves the fewest slots that carry a shard's slot along
    (from a primary's lowest slot up to the first shard slot it serves: redis-cli moves the lowest
    first), then that shard's slot goes back and forth between two primaries, key by key, until
    every session completed; half of the sessions live in that slot."""
    run = Run(cluster, broker, tmp_path, llm_server, delay=0.3)
    path = write_agent(run.agent)
    primaries = [n for n in cluster.nodes() if n["role"] == "primary"]
    moves = []
    for node in primaries:
        lo = min(a for a, _ in node["slots"])
        inside = [s for s in shard_slots(16) if any(a <= s <= b for a, b in node["slots"])]
        moves.append((min(inside) - lo + 1, node["port"], min(inside)))
    count, source, moved_slot = min(moves)
    target = next(n["port"] for n in primaries if n["port"] != source)
    migrations: list[tuple[float, int]] = []
    stop = threading.Event()

    def mover() -> None:
        began = time.monotonic()
        cluster.reshard(source, target, count)
        migrations.append((time.monotonic() - began, -1))
        cluster.wait(lambda: cluster._agree(moved_slot, target), "the nodes to agree")
        there = source
        while not stop.is_set():
            began = time.monotonic()
            keys = cluster.migrate_slot(moved_slot, there)
            migrations.append((time.monotonic() - began, keys))
            there = target if there == source else source
            # Still for as long as it moved: a loaded machine made each move take long enough that
            # the slot was moving nearly all the time, a step's script bounced for its whole 30 s.
            stop.wait(max(0.1, migrations[-1][0]))

    try:
        for _ in range(2):
            run.worker()
        with Client(run.settings, inline=False) as client:
            sids = start_sessions(client, path, [moved_slot])
            assert sum(tag_slot(s) == moved_slot for s in sids) >= SESSIONS // 2
            wait_for(lambda: run.model.total >= 4, timeout=60, what="the first model calls")
            moving = threading.Thread(target=mover, daemon=True)
            moving.start()
            wait_for(lambda: completed(client) >= SESSIONS, timeout=300, what="every session to complete")
            stop.set()
            moving.join(timeout=120)
            assert len(migrations) >= 2, "the shard's slot moved while sessions ran"
            assert max(keys for _, keys in migrations) > 0, "keys of running sessions moved"
            run.check_all(client, sids)
    finally:
        stop.set()
        run.close()
    report(
        "cluster reshard under load",
        sessions=SESSIONS,
        reshard_slots=count,
        reshard_s=round(migrations[0][0], 2),
        slot_moves=len(migrations) - 1,
        keys_per_move=max(keys for _, keys in migrations),
        model_calls=run.model.total,
    )


def test_a_primary_killed_under_load_is_replaced_by_its_replica_and_every_session_completes(
    cluster: RedisCluster, broker: str, tmp_path: Path, llm_server: LlmServer, write_agent: Any
) -> None:
    run = Run(cluster, broker, tmp_path, llm_server, delay=0.1)
    path = write_agent(run.agent)
    victim_slot = shard_slots(16)[0]
    victim = cluster.owner(victim_slot)
    try:
        for _ in range(2):
            run.worker()
        with Client(run.settings, inline=False) as client:
            sids = start_sessions(client, path, [victim_slot])
            wait_for(lambda: run.model.total >= SESSIONS, timeout=120, what="a third of the model calls")
            done_at_kill = completed(client)
            cluster.kill(victim)
            killed = time.monotonic()
            promoted = cluster.wait_promoted(victim, victim_slot)
            failover_s = time.monotonic() - killed
            wait_for(lambda: completed(client) >= SESSIONS, timeout=300, what="every session to complete")
            all_done_s = time.monotonic() - killed
            run.check_all(client, sids)
            doctor = client.doctor()
            assert doctor["owed_steps"] == 0 and doctor["pending_calls"] == 0
    finally:
        run.close()
    report(
        "cluster primary killed under load",
        sessions=SESSIONS,
        completed_at_kill=done_at_kill,
        promoted=promoted != victim,
        failover_s=round(failover_s, 2),
        all_completed_after_kill_s=round(all_done_s, 2),
        model_calls=run.model.total,
    )


def test_a_worker_killed_mid_step_on_a_cluster_is_replaced_and_nothing_committed_runs_again(
    cluster: RedisCluster, broker: str, tmp_path: Path, llm_server: LlmServer, write_agent: Any
) -> None:
    run = Run(cluster, broker, tmp_path, llm_server, delay=0.0)
    path = write_agent(run.agent)
    try:
        doomed = run.worker(AGENTS_FAULT_PAUSE="after_commit")
        with Client(run.settings, inline=False) as client:
            store = client.store
            sid = client.start(path, "session 0", run=True, wait=False).session_id
            wait_for(lambda: store.client.get(store.keys.fault("after_commit")) == sid, what="the first commit")
            doomed.kill()
            killed = time.monotonic()
            run.worker()
            wait_for(lambda: store.header(sid).status.value != "active", timeout=90, what="a fresh worker to finish")
            recovery = time.monotonic() - killed
            run.check_all(client, [sid])
    finally:
        run.close()
    report("cluster worker SIGKILL after commit", recovery_s=round(recovery, 2), model_calls=run.model.total)


def test_a_sub_agent_tree_under_a_budget_runs_in_its_parents_slot(
    cluster: RedisCluster, broker: str, tmp_path: Path, llm_server: LlmServer, write_agent: Any
) -> None:
    """A parent with a budget asks a sub-agent: the child (its id derived from the call) lands in
    the parent's slot, its claims on the parent's budget are one script, and a fork of the parent
    lands beside it; the tree completes on the Cluster with one child and each model asked twice."""
    from tests.chaos.invariants import check_tree

    run = Run(cluster, broker, tmp_path, llm_server, delay=0.0)

    def by_turn(first: Reply, then: Any) -> Any:
        return lambda body: then(body) if body["messages"][-1]["role"] == "tool" else first

    def last_tool(body: dict[str, Any]) -> str:
        return str(next(m["content"] for m in reversed(body["messages"]) if m["role"] == "tool"))

    child_model = llm_server.scenario([by_turn(calls(("look", {"x": 1})), lambda body: text("found it"))])
    write_agent(
        {
            "slug": "helper",
            "model": f"openai/{child_model}",
            "apiBase": llm_server.url,
            "tools": [record_tool("look", run.log)],
        },
        "helper.json",
    )
    parent_model = llm_server.scenario(
        [by_turn(calls(("prompt_agent_helper", {"prompt": "look"})), lambda body: text(f"boss: {last_tool(body)}"))]
    )
    path = write_agent(
        {
            "slug": "boss",
            "model": f"openai/{parent_model}",
            "apiBase": llm_server.url,
            "subAgents": ["helper.json"],
            "budget": {"toolCalls": 5, "modelCalls": 10},
        },
        "boss.json",
    )
    try:
        run.worker()
        with Client(run.settings, inline=False) as client:
            store = client.store
            view = client.start(path, "go", run=True, timeout=120)
            sid = view.session_id
            assert view.state.value == "completed" and store.header(sid).response == "boss: found it"
            tree = check_tree(store, sid)
            assert len(tree) == 2 and tag_slot(tree[1]) == tag_slot(sid), "the child shares its parent's slot"
            assert store.header(sid).spent.tool_calls == 2, "the child's tool call and the sub-agent call"
            fork = store.fork_session(store.origin_at(sid, 1))
            assert tag_slot(fork.header.session_id) == tag_slot(sid), "a fork lands beside its origin"
    finally:
        run.close()
    assert (llm_server.count(parent_model), llm_server.count(child_model)) == (2, 2)
    assert len(runs(run.log, "look", phase="start")) == 1
