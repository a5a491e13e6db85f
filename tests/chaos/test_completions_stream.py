"""The completions stream under entries no one should write and under a consumer that dies: every
entry is applied or rejected with a reason, and acknowledged; of two completions of one token the
first written wins even when the consumer that read it died before applying it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.runtime.completions import GROUP
from tests.chaos.conftest import Fleet, report
from tests.chaos.invariants import check_invariants
from tests.e2e.conftest import wait_for
from tests.support.llm_server import LlmServer, Reply, calls, text

pytestmark = pytest.mark.slow


def approve_then_answer(body: dict[str, Any]) -> Reply:
    if body["messages"][-1]["role"] == "tool":
        return text(f"got {body['messages'][-1]['content']}")
    return calls(("approve", {"n": 1}))


def deferred_agent(llm_server: LlmServer, write_agent: Any) -> Path:
    scenario = llm_server.scenario([approve_then_answer])
    path: Path = write_agent(
        {
            "slug": "stream",
            "model": f"openai/{scenario}",
            "apiBase": llm_server.url,
            "tools": [{"name": "approve", "external": True}],
        }
    )
    return path


def rejected(raw: redis.Redis, prefix: str) -> list[dict[str, str]]:
    out = []
    for _id, fields in raw.xrange(f"{prefix}:completions:rejected"):
        out.append({k.decode(): v.decode("utf-8", "replace") for k, v in fields.items()})
    return out


def test_poison_entries_are_rejected_and_the_batch_around_them_applies(
    fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    fleet.start()
    path = deferred_agent(llm_server, write_agent)
    raw = redis.Redis.from_url(fleet.redis_url)
    stream = f"{fleet.prefix}:completions"
    with Client(chaos_settings, inline=False) as client:
        views = [client.start(path, f"s{i}", run=True, timeout=30) for i in range(2)]
        tokens = [v.pending[0].token for v in views]
        assert all(tokens)
        # One transaction: the consumer reads poison and legitimate entries in one batch.
        pipe = raw.pipeline(transaction=True)
        pipe.xadd(stream, {"token": tokens[0], "result": b'{"ok": "\xff\xfe"}'})  # not UTF-8
        pipe.xadd(stream, {"token": b"\xc3\x28", "result": "1"})  # a token that is not UTF-8
        pipe.xadd(stream, {"token": tokens[0], "result": "1" * 5000})  # beyond Python's int limit
        pipe.xadd(stream, {"token": tokens[0], "result": "[" * 3000 + "]" * 3000})  # 3,000 deep
        pipe.xadd(stream, {"result": "1"})  # no token
        pipe.xadd(stream, {"token": tokens[0], "result": '{"approved": 0}'})
        pipe.xadd(stream, {"token": tokens[1], "result": '{"approved": 1}'})
        pipe.execute()
        started = time.monotonic()
        for v in views:
            wait_for(
                lambda v=v: client.store.header(v.session_id).status.value == "completed",
                timeout=30,
                what="the legitimate completions to apply",
            )
        applied_s = time.monotonic() - started
        for i, v in enumerate(views):
            assert client.store.header(v.session_id).response == f'got {{"approved": {i}}}'
            check_invariants(client.store, v.session_id)
        wait_for(lambda: len(rejected(raw, fleet.prefix)) == 5, what="five rejections")
        reasons = sorted(r["reason"] for r in rejected(raw, fleet.prefix))
        assert reasons == ["invalid_entry", "invalid_entry", "invalid_result", "invalid_result", "invalid_result"]
        assert raw.xpending(stream, GROUP)["pending"] == 0, "every entry acknowledged"
        assert raw.xlen(stream) == 0
        doc = client.doctor()
        assert doc["completions"]["pending"] == 0
        assert next(c for c in doc["checks"] if c["name"] == "completions")["ok"]
    log = (tmp_path / "worker0.log").read_text()
    assert "applying completions failed" not in log
    report("completions poison", rejected=5, legitimate_applied=2, applied_within_s=round(applied_s, 2))


def test_takeover_applies_the_dead_consumers_entries_first(
    fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer, write_agent: Any
) -> None:
    doomed = fleet.start(AGENTS_FAULT_PAUSE="completion_read")  # first up: it consumes the stream
    fleet.start()  # waits to take over
    path = deferred_agent(llm_server, write_agent)
    raw = redis.Redis.from_url(fleet.redis_url, decode_responses=True)
    stream = f"{fleet.prefix}:completions"
    with Client(chaos_settings, inline=False) as client:
        view = client.start(path, "go", run=True, timeout=30)
        token = view.pending[0].token
        assert token
        raw.xadd(stream, {"token": token, "result": '"first"'})
        wait_for(lambda: raw.get(f"{fleet.prefix}:fault:completion_read"), what="the consumer to read the entry")
        doomed.kill()
        raw.xadd(stream, {"token": token, "result": '"second"'})
        wait_for(
            lambda: client.store.header(view.session_id).status.value == "completed",
            timeout=60,
            what="the new consumer to apply",
        )
        assert client.store.header(view.session_id).response == "got first", "the first completion written wins"
        check_invariants(client.store, view.session_id)
        wait_for(lambda: raw.xpending(stream, GROUP)["pending"] == 0, what="nothing left pending")
        late = [r for r in rejected(redis.Redis.from_url(fleet.redis_url), fleet.prefix)]
        assert [r["reason"] for r in late] == ["token_already_completed"]
    report("completions takeover", winner="first", rejected_late=1)


def test_doctor_shows_stuck_completions(chaos_settings: Settings, redis_url: str, prefix: str) -> None:
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    stream = f"{prefix}:completions"
    raw.xgroup_create(stream, GROUP, id="0", mkstream=True)
    now_ms = int(raw.time()[0]) * 1000
    raw.xadd(stream, {"token": "x", "result": "1"}, id=f"{now_ms - 120_000}-0")  # written two minutes ago
    raw.xreadgroup(GROUP, "a-consumer-that-died", {stream: ">"}, count=1)  # read, never acknowledged
    raw.xadd(stream, {"token": "y", "result": "2"})  # not read yet
    with Client(chaos_settings, inline=False) as client:
        doc = client.doctor()
    stuck = doc["completions"]
    assert stuck["pending"] == 1 and stuck["waiting"] == 2
    assert stuck["oldest_s"] >= 119
    check = next(c for c in doc["checks"] if c["name"] == "completions")
    assert not check["ok"] and "1 read but not acknowledged" in check["detail"]
    assert not doc["ok"]
