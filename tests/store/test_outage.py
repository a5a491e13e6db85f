"""A worker's store waits out an unreachable Redis (killed and restarted from its append-only
file) up to its bound: what it sends meanwhile goes through, once, when Redis is back; past the
bound, and at once for a store with no bound (the CLI's), `RedisUnavailable`."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_agents.config import Settings
from celery_agents.errors import RedisUnavailable
from celery_agents.store import Store, client_for_url
from tests.e2e.conftest import wait_for
from tests.store.scenario import begin, start
from tests.support.proxy import TcpProxy
from tests.support.redis_server import RedisServer, free_port


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path / "redis", appendonly=True, appendfsync="always").start()
    yield s
    s.stop(kill=True)


def store_on(server: RedisServer, settings: Settings, outage_seconds: float) -> Store:
    return store_on_url(server.url, settings, outage_seconds)


def store_on_url(url: str, settings: Settings, outage_seconds: float) -> Store:
    return Store(client_for_url(url), dataclasses.replace(settings, redis_url=url), outage_seconds)


def test_a_write_sent_while_redis_is_away_goes_through_once_it_is_back(
    server: RedisServer, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    store = store_on(server, settings, outage_seconds=30)
    sid = start(store)
    loaded = begin(store, sid, "worker-a")
    server.stop(kill=True)
    done: dict[str, Any] = {}

    def journal() -> None:
        started = time.monotonic()
        done["value"] = store.journal_put(sid, "tool:0", '{"ran": 1}', "worker-a", loaded.header.version)
        done["waited"] = time.monotonic() - started

    caplog.set_level(logging.WARNING, logger="celery_agents.store")
    writer = threading.Thread(target=journal)
    writer.start()
    wait_for(lambda: "waiting up to 30 s" in caplog.text, what="the store to find Redis away")
    server.start()
    writer.join(timeout=30)
    assert done["value"] == '{"ran": 1}'
    assert store.client.hget(store.keys.journal(sid), "tool:0") == '{"ran": 1}'
    assert "Redis is reachable again" in caplog.text
    assert done["waited"] < 30


def test_past_its_bound_the_store_gives_up_saying_so(server: RedisServer, settings: Settings) -> None:
    store = store_on(server, settings, outage_seconds=0.5)
    sid = start(store)
    server.stop(kill=True)
    started = time.monotonic()
    with pytest.raises(RedisUnavailable, match=r"gave up after 0\.\d s \(AGENTS_REDIS_OUTAGE_SECONDS=0\.5\)"):
        store.header(sid)
    assert time.monotonic() - started < 5


def test_what_a_tool_did_is_written_however_long_past_the_bound_redis_stays_away(
    server: RedisServer, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """A journal entry of a tool's result waits for Redis past the bound (giving up would run the
    tool again); anything else, the inbox's journal entry among it, gives up at the bound."""
    store = store_on(server, settings, outage_seconds=0.5)
    sid = start(store)
    loaded = begin(store, sid, "worker-a")
    version = loaded.header.version
    server.stop(kill=True)
    done: dict[str, Any] = {}

    def journal() -> None:
        done["value"] = store.journal_put(sid, "tool:0", '{"ran": 1}', "worker-a", version, effect=True)

    caplog.set_level(logging.WARNING, logger="celery_agents.store")
    writer = threading.Thread(target=journal)
    writer.start()
    with pytest.raises(RedisUnavailable, match="gave up"):
        store.journal_put(sid, "inbox:1", "1", "worker-a", version)
    wait_for(lambda: "a tool's outcome waits for Redis past" in caplog.text, what="the store to say it waits on")
    writer.join(timeout=2)
    assert writer.is_alive(), "it did not give up at the bound"
    server.start()
    writer.join(timeout=30)
    assert done["value"] == '{"ran": 1}'
    assert store.client.hget(store.keys.journal(sid), "tool:0") == '{"ran": 1}'


def test_a_store_without_a_bound_and_an_at_once_copy_fail_at_the_first_failure(
    server: RedisServer, settings: Settings
) -> None:
    patient = store_on(server, settings, outage_seconds=30)
    sid = start(patient)
    server.stop(kill=True)
    for store in (store_on(server, settings, outage_seconds=0), patient.at_once()):
        started = time.monotonic()
        with pytest.raises(RedisUnavailable, match=r"^cannot reach Redis: Error"):
            store.begin_step(sid, 1, "worker-a")
        assert time.monotonic() - started < 5
    assert patient.outage.seconds == 30, "the copy's impatience is its own"


def test_a_pipeline_whose_connection_broke_mid_reply_is_sent_whole_once_redis_is_back(
    server: RedisServer, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """The fleet's limits are read in one pipeline. When its connection breaks after the request
    went out and redis-py's own retries cannot reconnect, redis-py empties the pipeline; waiting
    out the outage by sending that same pipeline again sent nothing, and the read failed (not
    enough values to unpack) instead of waiting."""
    with TcpProxy(server.port) as proxy:
        store = store_on_url(proxy.url, settings, outage_seconds=30)
        store.client.hset(store.keys.limits, "team-a", '{"rpm": 60}')
        dead = free_port()
        proxy.drop_reply_to(store.keys.limits_paused)
        proxy.target_port = dead  # the connection open stays up; new ones find nobody
        done: dict[str, Any] = {}

        def read() -> None:
            try:
                done["limits"] = store._read_fleet_limits()
            except Exception as exc:  # the failure the test is about, reported below
                done["error"] = exc

        caplog.set_level(logging.WARNING, logger="celery_agents.store")
        reader = threading.Thread(target=read)
        reader.start()
        wait_for(lambda: "waiting up to 30 s" in caplog.text or not reader.is_alive(), what="the read to wait")
        proxy.target_port = server.port
        reader.join(timeout=30)
    assert "error" not in done, repr(done.get("error"))
    assert list(done["limits"].limits) == ["team-a"]


def test_a_dispatched_call_picked_up_while_redis_is_away_waits_for_it_and_runs_once(
    server: RedisServer, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker that takes a dispatched call reads it, takes its lease and lets it go through
    the same wait: a Redis away for a moment (restarted, a Cluster slot moving) costs the call a
    pause, not its task (which left it to the sweeper)."""
    from celery_agents.llm import LitellmPort
    from celery_agents.model import UserQuery
    from celery_agents.runtime import run_call, run_step
    from celery_agents.tools import ToolRunner
    from celery_agents.tools.resolve import load_agent_file

    store = store_on(server, settings, outage_seconds=30)
    demo = load_agent_file(Path(__file__).resolve().parents[2] / "examples" / "demo-agent.json")
    sid = store.create_session(demo, UserQuery(text="What is the weather in Paris?"), drive="manual").session_id
    llm, tools = LitellmPort(), ToolRunner()
    run_step(store, sid, 1, llm=llm, tools=tools, owner="w")
    field = run_step(store, sid, 2, llm=llm, tools=tools, owner="w").dispatch[0].field
    caplog.set_level(logging.WARNING, logger="celery_agents.store")
    server.stop(kill=True)
    done: dict[str, Any] = {}

    def take_it() -> None:
        try:
            done["run"] = run_call(store, sid, field, tools, "worker-a", "runAsync")
        except BaseException as exc:
            done["error"] = exc

    taker = threading.Thread(target=take_it)
    taker.start()
    wait_for(lambda: "waiting up to 30 s" in caplog.text or done, what="the call's worker to find Redis away")
    server.start()
    taker.join(timeout=30)
    assert "error" not in done, done.get("error")
    assert done["run"].status == "ok"
    assert not store.client.exists(store.keys.call_lease(sid, field)), "its lease let go"
