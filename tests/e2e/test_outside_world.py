"""Waiting on the outside world: completions through Redis alone (the real redis-cli), racing
completers, expiry, pause and cancel — on real workers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.errors import TokenAlreadyCompleted, TokenCancelled, TokenExpired
from tests.e2e.conftest import record_tool, runs, wait_for
from tests.support.llm_server import LlmServer, calls, text
from tests.support.workers import pid_alive, worker_env

pytestmark = pytest.mark.slow

REDIS_CLI = shutil.which("redis-cli")


def external(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "description": f"{name}: answered by a person",
        "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}},
        "external": True,
    }


def agent(
    model: str, api_base: str, tools: list[dict[str, Any]], rules: list[dict[str, Any]] | None = None, **extra: Any
) -> dict[str, Any]:
    return {
        "slug": "outside",
        "model": f"openai/{model}",
        "apiBase": api_base,
        "tools": tools,
        "toolCallPolicy": {"default": "runSync", "rules": rules or []},
        **extra,
    }


def tool_answers(request: dict[str, Any]) -> list[tuple[str, str]]:
    return [(m["tool_call_id"], m["content"]) for m in request["messages"] if m["role"] == "tool"]


@pytest.mark.skipif(REDIS_CLI is None, reason="redis-cli is not installed")
def test_three_deferred_calls_completed_by_redis_cli_in_reverse_order(
    workers: Any, module_settings: Settings, llm_server: LlmServer, write_agent: Any, redis_url: str
) -> None:
    scenario = llm_server.scenario(
        [calls(("ask_a", {"n": 1}), ("ask_b", {"n": 2}), ("ask_c", {"n": 3})), text("thanks")]
    )
    path = write_agent(agent(scenario, llm_server.url, [external("ask_a"), external("ask_b"), external("ask_c")]))
    prefix = module_settings.prefix
    with Client(module_settings, inline=False) as client:
        view = client.start(path, "ask three people", run=True, timeout=30)
        assert view.state.value == "waiting"
        tokens = [p.token for p in view.pending]
        assert [p.tool for p in view.pending] == ["ask_a", "ask_b", "ask_c"] and all(tokens)
        assert len(set(tokens)) == 3

        def xadd(*fields: str) -> None:
            subprocess.run(
                [REDIS_CLI, "-u", redis_url, "XADD", f"{prefix}:completions", "*", *fields],
                check=True,
                capture_output=True,
            )

        xadd("token", tokens[2], "result", '{"answer": "c"}', "by", "carol")
        xadd("token", tokens[1], "result", "b said yes", "by", "bob")
        xadd("token", tokens[1], "result", "b said yes again")  # a duplicate
        xadd("token", f"{view.session_id}.unknownsecretunknownsecret", "result", "who am I")
        xadd("token", tokens[0], "result", "42", "by", "alice")

        store = client.store
        wait_for(lambda: store.header(view.session_id).state.value == "completed", what="the session to resume")
        assert store.header(view.session_id).response == "thanks"
        r = redis.Redis.from_url(redis_url, decode_responses=True)
        rejected = wait_for(
            lambda: (
                r.xrange(f"{prefix}:completions:rejected")
                if len(r.xrange(f"{prefix}:completions:rejected")) >= 2
                else None
            ),
            what="rejections",
        )
        reasons = sorted(fields["reason"] for _, fields in rejected[-2:])
        assert reasons == ["token_already_completed", "unknown_token"]
        calls_by_id = {c.call_id: c for c in store.calls(view.session_id)}
        assert calls_by_id["call_0_2"].completed_by == "carol"
    assert llm_server.count(scenario) == 2
    answers = tool_answers(llm_server.requests[scenario][-1])
    assert answers == [("call_0_0", "42"), ("call_0_1", "b said yes"), ("call_0_2", '{"answer": "c"}')]


def test_twenty_concurrent_completers_one_wins(
    workers: Any, module_settings: Settings, llm_server: LlmServer, write_agent: Any, redis_url: str, tmp_path: Path
) -> None:
    scenario = llm_server.scenario([calls(("ask_a", {"n": 1})), text("done")])
    path = write_agent(agent(scenario, llm_server.url, [external("ask_a")]))
    prefix = module_settings.prefix
    with Client(module_settings, inline=False) as client:
        view = client.start(path, "race", run=True, timeout=30)
        token = view.pending[0].token
        assert token
        (tmp_path / "result.txt").write_text("from the cli")
        env = worker_env(redis_url, prefix)
        r = redis.Redis.from_url(redis_url, decode_responses=True)
        before_rejected = r.xlen(f"{prefix}:completions:rejected") if r.exists(f"{prefix}:completions:rejected") else 0
        barrier = threading.Barrier(20)
        outcomes: list[tuple[str, Any]] = []

        def cli(i: int) -> None:
            barrier.wait()
            p = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "celery_agents.cli",
                    "session",
                    "complete",
                    token,
                    str(tmp_path / "result.txt"),
                    "--by",
                    f"cli{i}",
                    "--json",
                ],
                env=env,
                capture_output=True,
                text=True,
            )
            outcomes.append(("cli", (p.returncode, json.loads(p.stdout))))

        def stream(i: int) -> None:
            barrier.wait()
            r.xadd(f"{prefix}:completions", {"token": token, "result": f"from the stream {i}", "by": f"xadd{i}"})
            outcomes.append(("stream", None))

        threads = [threading.Thread(target=cli if i % 2 == 0 else stream, args=(i,)) for i in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wait_for(lambda: client.store.header(view.session_id).state.value == "completed", what="completion")
        # Every stream entry is applied: rejected, or (for at most one) accepted and acknowledged.
        wait_for(lambda: r.xlen(f"{prefix}:completions") == 0, what="the stream's completions to be applied")
        stream_rejections = r.xrange(f"{prefix}:completions:rejected")
        cli_results = [res for kind, res in outcomes if kind == "cli"]
        accepted_cli = [doc for rc, doc in cli_results if rc == 0]
        refused_cli = [doc for rc, doc in cli_results if rc != 0]
        assert all(rc in (0, 5) for rc, _ in cli_results)
        assert all(doc["error"]["code"] == "token_already_completed" for doc in refused_cli)
        new_rejections = stream_rejections[before_rejected:]
        assert all(f["reason"] == "token_already_completed" for _, f in new_rejections)
        accepted_stream = 10 - len(new_rejections)
        assert len(accepted_cli) + accepted_stream == 1, "exactly one completer won"
        (call,) = client.store.calls(view.session_id)
        assert call.state.value == "completed"
    answers = tool_answers(llm_server.requests[scenario][-1])
    assert len(answers) == 1


def test_expired_call_tells_the_model_and_refuses_late_completion(
    workers: Any, module_settings: Settings, llm_server: LlmServer, write_agent: Any
) -> None:
    scenario = llm_server.scenario([calls(("ask_a", {"n": 1})), text("I will try later")])
    path = write_agent(
        agent(
            scenario,
            llm_server.url,
            [external("ask_a")],
            rules=[
                {"tool": "ask_a", "disposition": {"tag": "defer", "reason": "a person answers", "timeoutSeconds": 0.5}}
            ],
        )
    )
    with Client(module_settings, inline=False) as client:
        view = client.start(path, "ask", run=True, timeout=30)
        store = client.store
        # The call may expire before start() returns on a loaded machine: read its token from the
        # call's record, which outlives the wait, not from the view's open calls.
        wait_for(lambda: store.header(view.session_id).state.value == "completed", what="expiry to wake the session")
        (call,) = store.calls(view.session_id)
        token = call.token
        assert token and call.expires_at and call.expires_at - call.created_at == pytest.approx(0.5)
        with pytest.raises(TokenExpired):
            client.complete(token, "too late")
        assert [e["type"] for e in store.read_events(view.session_id)].count("token_expired") == 1
    answer = tool_answers(llm_server.requests[scenario][-1])[0][1]
    assert "No result arrived before the deadline" in answer and "denied" not in answer.lower()


def test_pause_holds_and_resume_continues(
    workers: Any, module_settings: Settings, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    log = tmp_path / "runs.jsonl"
    scenario = llm_server.scenario([calls(("slow", {"x": 1}), delay=1.0), text("finished")])
    path = write_agent(agent(scenario, llm_server.url, [record_tool("slow", log)]))
    with Client(module_settings, inline=False) as client:
        sid = client.start(path, "go", run=True, wait=False).session_id
        store = client.store
        wait_for(lambda: store.lease_holder(sid), what="the first step to start")
        view = client.pause(sid)  # while the model is answering
        assert view.drive == "manual"
        wait_for(lambda: store.header(sid).version == 2, what="the in-flight step to commit")
        wait_for(lambda: store.lease_holder(sid) is None, what="the step to end")
        # Held: the next step (the tools) is not enqueued, even by the sweeper after its grace.
        assert store.client.zscore(store.keys.owed, sid) is None
        assert store.header(sid).state.value == "tools" and runs(log) == []
        view = client.resume(sid, timeout=30)
        assert view.state.value == "completed" and view.response == "finished"
        assert len(runs(log)) == 1


def test_cancel_kills_the_running_tool_and_refuses_tokens(
    workers: Any, module_settings: Settings, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    log = tmp_path / "runs.jsonl"
    scenario = llm_server.scenario([calls(("slow_async", {"x": 1, "sleep": 60}), ("ask_a", {"n": 1})), text("no")])
    path = write_agent(
        agent(
            scenario,
            llm_server.url,
            [record_tool("slow_async", log), external("ask_a")],
            rules=[{"tool": "slow_async", "disposition": "runAsync"}],
        )
    )
    with Client(module_settings, inline=False) as client:
        sid = client.start(path, "go", run=True, wait=False).session_id
        (started,) = wait_for(lambda: runs(log, phase="start"), what="the async tool to start")
        token = next(p.token for p in client.pending(sid) if p.tool == "ask_a")
        view = client.cancel(sid)
        assert view.state.value == "cancelled" and view.pending == []
        with pytest.raises(TokenCancelled):
            client.complete(token, "late")
        store = client.store
        calls_now = {c.tool: c.state.value for c in store.calls(sid)}
        assert calls_now == {"slow_async": "cancelled", "ask_a": "cancelled"}

        # The tool's process is killed (it would sleep a minute), and its worker lets go of the call.
        wait_for(lambda: not pid_alive(started["pid"]), timeout=10, what="the running tool to be killed")
        wait_for(lambda: not store.client.exists(store.keys.call_lease(sid, "1:0")), what="the call lease to go")
        assert runs(log, "slow_async", phase="end") == []
        assert {c.tool: c.state.value for c in store.calls(sid)} == calls_now
        assert store.header(sid).status.value == "cancelled"
        with pytest.raises(TokenCancelled):
            client.complete(token, "again")
    assert llm_server.count(scenario) == 1


def test_completed_token_cannot_be_reused(
    workers: Any, module_settings: Settings, llm_server: LlmServer, write_agent: Any
) -> None:
    scenario = llm_server.scenario([calls(("ask_a", {"n": 1})), text("ok")])
    path = write_agent(agent(scenario, llm_server.url, [external("ask_a")]))
    with Client(module_settings, inline=False) as client:
        view = client.start(path, "go", run=True, timeout=30)
        token = view.pending[0].token
        assert client.complete(token, {"ok": True}, by="me").accepted
        with pytest.raises(TokenAlreadyCompleted):
            client.complete(token, {"ok": False})
