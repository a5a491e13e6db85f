"""A reply lost on its way back from Redis: the client library retries the call on the
connection error, so the write runs twice. The outcome a caller reports must be the first one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.model import CallState, UserQuery
from celery_agents.runtime import run_step
from celery_agents.runtime.completions import CompletionConsumer
from celery_agents.store import Store, client_for_url, outcome_json
from tests.chaos.conftest import report
from tests.chaos.invariants import check_invariants
from tests.scheduler.fakes import RecordingTools, ScriptedLlm, llm_turn, make_agent
from tests.support.proxy import TcpProxy
from tests.support.redis_server import RedisServer


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[TcpProxy]:
    with TcpProxy(redis_server.port) as p:
        yield p


@pytest.fixture
def proxied(proxy: TcpProxy, prefix: str, tmp_path: Path) -> Settings:
    return Settings(redis_url=proxy.url, prefix=prefix, home=tmp_path / "home", lease_seconds=2, owed_grace=1)


def lose_reply(proxy: TcpProxy, store: Store, script: str) -> object:
    """The next call of `script` runs, and its reply never reaches the caller."""
    store.scripts.load_all()  # so that the call lost is the write itself, not a NOSCRIPT answer
    return proxy.drop_reply_to(store.scripts.sha(script))


def test_start_whose_reply_was_lost_reports_the_session_it_made(proxy: TcpProxy, proxied: Settings) -> None:
    with Client(proxied, inline=True, llm=ScriptedLlm(llm_turn(text="hi")), tools=RecordingTools()) as client:
        dropped = lose_reply(proxy, client.store, "create_session")
        view = client.start(make_agent(), "hello", run=True)
        assert dropped.is_set()  # type: ignore[attr-defined]
        assert view.state.value == "completed" and view.response == "hi"
        assert sum(client.store.state_counts().values()) == 1, "one session, not two"
        check_invariants(client.store, view.session_id)


def test_complete_whose_reply_was_lost_is_accepted(proxy: TcpProxy, proxied: Settings) -> None:
    llm = ScriptedLlm(llm_turn(("c1", "defer_t", "{}")), llm_turn(text="approved"))
    with Client(proxied, inline=True, llm=llm, tools=RecordingTools()) as client:
        sid = client.start(make_agent(), "pay", run=True).session_id
        (pending,) = client.pending(sid)
        assert pending.token
        dropped = lose_reply(proxy, client.store, "complete_token")
        outcome = client.complete(pending.token, {"ok": True})
        assert dropped.is_set()  # type: ignore[attr-defined]
        assert (outcome.accepted, outcome.remaining) == (True, 0)
        rejected = [e for e in client.store.read_events(sid) if e["type"] == "token_rejected"]
        assert rejected == [], "the retry of this very completion is not a rejected second one"
        assert client.resume(sid).response == "approved"
        check_invariants(client.store, sid)


def test_step_whose_commit_reply_was_lost_goes_on(proxy: TcpProxy, proxied: Settings) -> None:
    llm = ScriptedLlm(llm_turn(("c1", "async_t", "{}")), llm_turn(text="done"))
    tools = RecordingTools()
    with Client(proxied, inline=True, llm=llm, tools=tools) as client:
        sid = client.start(make_agent(), "go", step=True).session_id
        dropped = lose_reply(proxy, client.store, "commit_step")  # the commit that dispatches async_t
        view = client.resume(sid)
        assert dropped.is_set()  # type: ignore[attr-defined]
        report("commit reply lost", state=view.state.value, async_runs=len(tools.runs))
        assert view.state.value == "completed", "the committed step's async call ran and the session went on"
        assert [c.tool for c in tools.runs] == ["async_t"]
        check_invariants(client.store, view.session_id)


def test_cancel_whose_reply_was_lost_reports_the_cancel(proxy: TcpProxy, proxied: Settings) -> None:
    with Client(proxied, inline=True, llm=ScriptedLlm(), tools=RecordingTools()) as client:
        sid = client.start(make_agent(), "hello").session_id
        dropped = lose_reply(proxy, client.store, "cancel_session")
        view = client.cancel(sid)
        assert dropped.is_set()  # type: ignore[attr-defined]
        assert view.state.value == "cancelled"
        assert [e["type"] for e in client.store.read_events(sid)].count("cancelled") == 1


def test_record_result_whose_reply_was_lost_wakes_the_session(proxy: TcpProxy, proxied: Settings) -> None:
    llm = ScriptedLlm(llm_turn(("c1", "async_t", "{}")))
    store = Store(client_for_url(proxied.redis_url or ""), proxied)
    try:
        sid = store.create_session(make_agent(), UserQuery(text="go"), drive="auto").session_id
        version = run_step(store, sid, 1, llm=llm, tools=RecordingTools(), owner="w").version
        res = run_step(store, sid, version, llm=llm, tools=RecordingTools(), owner="w")
        (call,) = res.dispatch
        dropped = lose_reply(proxy, store, "record_result")
        done = outcome_json(CallState.COMPLETED, result="ok", now=0.0, attempts=1)
        finished = store.record_result(sid, call.field, done, {"call_id": call.call_id})
        assert dropped.is_set()  # type: ignore[attr-defined]
        assert (finished.status, finished.woken) == ("ok", True), "this call finished the last one: wake the session"
    finally:
        store.client.close()


def test_a_stream_completion_whose_reply_was_lost_is_applied_and_not_rejected(
    proxy: TcpProxy, proxied: Settings
) -> None:
    llm = ScriptedLlm(llm_turn(("c1", "defer_t", "{}")), llm_turn(text="approved"))
    with Client(proxied, inline=True, llm=llm, tools=RecordingTools()) as client:
        store = client.store
        sid = client.start(make_agent(), "pay", run=True).session_id
        (pending,) = client.pending(sid)
        store.client.xadd(store.keys.completions, {"token": pending.token or "", "result": '"yes"', "by": "erp"})
        dropped = lose_reply(proxy, store, "complete_token")
        CompletionConsumer(store, "consumer").poll(block_ms=None)
        assert dropped.is_set()  # type: ignore[attr-defined]
        assert store.client.xlen(store.keys.rejected) == 0, "the completion applied is not also logged as rejected"
        assert client.pending(sid) == []
        assert client.resume(sid).response == "approved"
        check_invariants(store, sid)


def test_the_proxy_holds_every_byte_while_hung(proxy: TcpProxy) -> None:
    """The proxy's own check: a hung connection times out its client; once released it serves again."""
    client = redis.Redis(port=proxy.port, socket_timeout=0.3)
    try:
        assert client.ping()
        proxy.hang()
        with pytest.raises(redis.TimeoutError):
            client.ping()
        proxy.release()
        proxy.close_all()
        assert client.ping()
    finally:
        client.close()


def test_a_call_whose_lease_reply_was_lost_still_runs(proxy: TcpProxy, proxied: Settings) -> None:
    llm = ScriptedLlm(llm_turn(("c1", "async_t", "{}")), llm_turn(text="done"))
    tools = RecordingTools()
    with Client(proxied, inline=True, llm=llm, tools=tools) as client:
        dropped = proxy.drop_reply_to(":call-lease:")  # the SET NX that takes the call's lease
        view = client.start(make_agent(), "go", run=True)
        assert dropped.is_set()
        assert view.state.value == "completed", "the call ran although the reply to taking its lease was lost"
        assert [c.tool for c in tools.runs] == ["async_t"]
        check_invariants(client.store, view.session_id)
