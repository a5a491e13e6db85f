"""A worker stays up through what is not a crash of its own: poison messages on its queues and a
Redis restart while it runs a task; and it refuses to start on a Redis that may evict keys."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_agents import Client
from celery_agents.config import Settings
from tests.chaos.conftest import Fleet, report
from tests.chaos.invariants import check_invariants
from tests.e2e.conftest import record_tool, runs, wait_for
from tests.support.llm_server import LlmServer, Reply, calls, text
from tests.support.redis_server import RedisServer
from tests.support.workers import worker_env

pytestmark = pytest.mark.slow

POISON: list[bytes] = [
    b"garbage",  # not JSON
    b"\xff\xfe\x00 not utf-8",
    b"42",  # JSON, not a message
    b'{"body": "x"}',  # a dict without the message's properties
    b'{"body": "x", "properties": {"delivery_tag": "t"}}',  # no delivery info
]


def one_tool(sleep: float = 0.0) -> Any:
    def reply(body: dict[str, Any]) -> Reply:
        if body["messages"][-1]["role"] == "tool":
            return text("done")
        return calls(("sync_tool", {"x": 1, "sleep": sleep}))

    return reply


def agent(scenario: str, url: str, log: Path) -> dict[str, Any]:
    return {"slug": "avail", "model": f"openai/{scenario}", "apiBase": url, "tools": [record_tool("sync_tool", log)]}


def test_poison_on_every_queue_is_set_aside_and_the_worker_goes_on(
    fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    worker = fleet.start()
    raw = redis.Redis.from_url(fleet.redis_url)
    celery_prefix = f"{fleet.prefix}:celery:"
    for queue in ("steps", "tools", "isolated"):
        raw.lpush(celery_prefix + queue, *POISON)
    scenario = llm_server.scenario([one_tool()])
    path = write_agent(agent(scenario, llm_server.url, tmp_path / "runs.jsonl"))
    with Client(chaos_settings, inline=False) as client:
        sid = client.start(path, "go", run=True, timeout=60).session_id
        check_invariants(client.store, sid)
        wait_for(lambda: raw.llen(celery_prefix + "poison") == 3 * len(POISON), what="every poison set aside")
        assert worker.proc is not None and worker.proc.poll() is None, "the worker is still running"
        kept = [json.loads(m) for m in raw.lrange(celery_prefix + "poison", 0, -1)]
        assert {k["queue"] for k in kept} == {"steps", "tools", "isolated"}
        assert {k["reason"] for k in kept} >= {"not_utf8", "not_json", "not_a_message"}

        report_ = client.doctor()
        assert report_["poison_messages"] == 3 * len(POISON)
        check = next(c for c in report_["checks"] if c["name"] == "poison messages")
        assert not check["ok"] and "celery:poison" in check["detail"]
    assert "poison" in (tmp_path / "worker0.log").read_text()
    report("poison queue messages", set_aside=3 * len(POISON), worker_alive=True)


@pytest.mark.parametrize("stop", ["killed", "shut down"])
def test_worker_survives_redis_restart_while_it_runs_a_task(
    stop: str, tmp_path: Path, prefix: str, llm_server: LlmServer, write_agent: Any
) -> None:
    server = RedisServer(tmp_path / "redis", appendonly=True, appendfsync="always").start()
    fleet = Fleet(server.url, prefix, tmp_path)
    try:
        settings = Settings(redis_url=server.url, prefix=prefix, home=tmp_path / "home", lease_seconds=2, owed_grace=1)
        log = tmp_path / "runs.jsonl"
        scenario = llm_server.scenario([one_tool(sleep=6)])
        path = write_agent(agent(scenario, llm_server.url, log))
        worker = fleet.start()
        with Client(settings, inline=False) as client:
            sid = client.start(path, "go", run=True, wait=False).session_id
        wait_for(lambda: runs(log, "sync_tool", phase="start"), what="the tool to start")
        restarted_at = time.monotonic()
        server.stop(kill=stop == "killed")
        time.sleep(1)  # Redis stays down a moment: the worker must wait for it, not die
        server.start()
        with Client(settings, inline=False) as client:
            wait_for(
                lambda: client.store.header(sid).status.value != "active",
                timeout=90,
                what="the session to finish after the restart",
            )
            recovery = time.monotonic() - restarted_at
            check_invariants(client.store, sid)
        # Still the same process, still serving: a second session runs on it.
        assert worker.proc is not None and worker.proc.poll() is None, f"the worker died; see {worker.log}"
        with Client(settings, inline=False) as client:
            sid2 = client.start(path, "again", run=True, timeout=60).session_id
            check_invariants(client.store, sid2)
        assert worker.proc.poll() is None
        assert worker.log is not None
        text = worker.log.read_text()
        assert "Unrecoverable error" not in text, f"a worker process died; see {worker.log}"
        report("redis restart mid-task", redis=stop, recovery_s=round(recovery, 1), worker_alive=True)
    finally:
        fleet.stop()
        server.stop(kill=True)


def test_worker_refuses_an_evicting_redis(tmp_path: Path, prefix: str) -> None:
    server = RedisServer(tmp_path / "redis").start()
    try:
        admin = redis.Redis(port=server.port)
        admin.config_set("maxmemory-policy", "allkeys-lru")
        admin.config_set("maxmemory", "1gb")
        argv = [sys.executable, "-m", "celery_agents.cli", "worker", "--concurrency", "1"]
        refused = subprocess.run(argv, env=worker_env(server.url, prefix), capture_output=True, timeout=120)
        out = (refused.stdout + refused.stderr).decode()
        assert refused.returncode != 0, out
        assert "maxmemory-policy allkeys-lru" in out and "AGENTS_ALLOW_EVICTION=1" in out
        assert not redis.Redis(port=server.port).hlen(f"{prefix}:workers"), "no worker ever came up"
        # With the explicit override it starts (and is stopped as soon as its heartbeat shows).
        fleet = Fleet(server.url, prefix, tmp_path)
        try:
            fleet.start(AGENTS_ALLOW_EVICTION="1")
        finally:
            fleet.stop()
    finally:
        server.stop(kill=True)


def test_worker_refuses_a_redis_holding_another_stored_format(tmp_path: Path, prefix: str) -> None:
    server = RedisServer(tmp_path / "redis").start()
    try:
        redis.Redis(port=server.port).set(f"{prefix}:format", "99")
        argv = [sys.executable, "-m", "celery_agents.cli", "worker", "--concurrency", "1"]
        refused = subprocess.run(argv, env=worker_env(server.url, prefix), capture_output=True, timeout=120)
        out = (refused.stdout + refused.stderr).decode()
        assert refused.returncode != 0, out
        assert "data of format 99" in out and "AGENTS_PREFIX" in out, out[-2000:]
        assert not redis.Redis(port=server.port).hlen(f"{prefix}:workers"), "no worker ever came up"
    finally:
        server.stop(kill=True)
