"""10,000 steps through one `agents worker` leave it with the threads and Redis connections it had
after the first 1,000: nothing is held per step (threads, broker or state connections)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis

from celery_agents.config import Settings
from celery_agents.model import UserQuery
from celery_agents.store import Store
from celery_agents.tasks.config import Dispatcher, make_app
from celery_agents.tools.resolve import parse_agent
from tests.e2e.conftest import wait_for
from tests.support.workers import Worker, worker_env

pytestmark = pytest.mark.slow

THREADS = 8
LITELLM_LOGGING_THREADS = 4
WARM, TOTAL = 1_000, int(os.environ.get("AGENTS_LEAK_STEPS", "10000"))


def tree(pid: int) -> list[int]:
    """A process and its descendants (Linux /proc)."""
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            kids.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def threads(pids: list[int]) -> int:
    return sum(len(os.listdir(f"/proc/{p}/task")) for p in pids if os.path.exists(f"/proc/{p}"))


def redis_connections(pids: list[int], client: redis.Redis) -> int:
    """Connections in Redis's CLIENT LIST whose local end belongs to one of `pids`."""
    inodes = set()
    for p in pids:
        try:
            fds = os.listdir(f"/proc/{p}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{p}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        if cols[9] in inodes:
            ports.add(int(cols[1].split(":")[1], 16))
    return sum(1 for c in client.client_list() if int(c["addr"].rsplit(":", 1)[1]) in ports)


def test_ten_thousand_steps_leak_no_thread_and_no_connection(
    redis_url: str, prefix: str, settings: Settings, tmp_path: Path
) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    store = Store(client, settings)
    app = make_app(settings, main="leaks")
    dispatcher = Dispatcher(app)
    agent = parse_agent({"slug": "leaks", "model": "demo/bench"})
    # Few threads, so that the first 1,000 steps surely grow the pool to its size: any thread or
    # connection that appears afterwards is one that a step left behind. litellm runs its success
    # logging on a pool of its own that grows lazily, up to LOGGING_EXECUTOR_MAX_THREADS (100 by
    # default): capped here, so that its growth is told apart from a leak.
    env = worker_env(redis_url, prefix, LOGGING_EXECUTOR_MAX_THREADS=str(LITELLM_LOGGING_THREADS))
    worker = Worker(env, log=tmp_path / "worker.log", step_threads=THREADS).start()
    done = store.keys.state_index("completed")

    def run(n: int) -> None:
        target = client.zcard(done) + n
        for _ in range(n):
            dispatcher.step(store.create_session(agent, UserQuery(text="hi")).session_id, 1)
        wait_for(lambda: client.zcard(done) >= target, timeout=900, what=f"{n} steps")

    try:
        worker.wait_ready(client, prefix)
        assert worker.proc is not None
        run(WARM)  # the pools grow to what the concurrency needs
        pids = tree(worker.proc.pid)
        before = threads(pids), redis_connections(pids, client)
        run(TOTAL - WARM)
        assert set(tree(worker.proc.pid)) == set(pids), "no worker process was replaced or added"
        after = threads(pids), redis_connections(pids, client)
        assert client.zcard(store.keys.state_index("failed")) == 0
    finally:
        worker.stop()
        app.close()
    print(f"\n[leaks] threads {before[0]} -> {after[0]}, redis connections {before[1]} -> {after[1]}")
    assert after[0] <= before[0] + LITELLM_LOGGING_THREADS, (
        f"threads grew from {before[0]} to {after[0]} over {TOTAL - WARM} steps"
    )
    # A pool may still reach a new peak (at most one more connection per thread); a connection
    # left behind per step would add thousands.
    assert after[1] <= before[1] + THREADS, f"Redis connections grew from {before[1]} to {after[1]}"
