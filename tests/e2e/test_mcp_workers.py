"""MCP tools under every disposition with real workers and the scripted model server: runSync
from the step's worker, runAsync from a tools worker, runIsolated with the server started inside
the sandbox, defer without calling the server; a server killed between calls is started again, a
hung one is cut off at the call's timeout, and the servers stop with their worker."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.model import State
from tests.e2e.conftest import wait_for
from tests.support.llm_server import LlmServer, Reply, calls, text
from tests.support.workers import Worker, pid_alive, worker_env
from tests.tools.mcp.conftest import SAMPLE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"m{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def workers(redis_url: str, prefix: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Worker]]:
    """A worker for steps and one for tool calls (one pool process each), so where a call ran shows."""
    logs = tmp_path_factory.mktemp("mcp-worker-logs")
    started = {
        queues: Worker(
            worker_env(redis_url, prefix, OPENAI_API_KEY="sk-mcp-e2e"),
            queues=queues,
            concurrency=1,
            log=logs / f"{queues}.log",
            name=f"{queues.replace(',', '-')}-{uuid.uuid4().hex[:6]}@test",
        ).start()
        for queues in ("steps", "tools,isolated")
    }
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        for w in started.values():
            w.wait_ready(client, prefix)
        yield started
    finally:
        for w in started.values():
            w.stop()
        client.close()


def write_agent(folder: Path, llm_server: LlmServer, scenario: str, call_log: Path) -> Path:
    server = {"command": [sys.executable, str(SAMPLE)], "env": {"CALL_LOG": str(call_log)}}
    path = folder / "mcp-agent.json"
    path.write_text(
        json.dumps(
            {
                "slug": "mcp-e2e",
                "model": f"openai/{scenario}",
                "apiBase": llm_server.url,
                "mcpServers": [{"name": "near", **server}, {"name": "far", **server}],
                "toolCallPolicy": {
                    "default": "runSync",
                    "rules": [
                        {"tool": "mcp__far__*", "disposition": "runAsync"},
                        {"tool": "mcp__near__whoami", "disposition": "runSync"},
                        {"tool": "mcp__near__sleep", "disposition": {"tag": "runSync", "timeoutSeconds": 3}},
                        {"tool": "mcp__near__*", "disposition": {"tag": "defer", "reason": "approve it"}},
                        {"tool": "mcp__far__image", "disposition": {"tag": "runIsolated", "timeoutSeconds": 90}},
                    ],
                },
            }
        )
    )
    return path


def settings(redis_url: str, prefix: str, home: Path) -> Settings:
    return Settings(redis_url=redis_url, prefix=prefix, home=home, sweep_interval=0.2, owed_grace=2.0)


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def runs_under(pid: int, worker: Worker) -> bool:
    """Whether `pid` is one of the worker's processes (the worker, its pool processes, ...)."""
    assert worker.proc is not None
    while pid > 1:
        if pid == worker.proc.pid:
            return True
        pid = parent_of(pid)
    return False


def tool_messages(request: dict[str, Any]) -> dict[str, str]:
    return {m["tool_call_id"]: m["content"] for m in request["messages"] if m["role"] == "tool"}


def test_each_disposition_runs_where_it_says_and_defer_never_calls_the_server(
    workers: dict[str, Worker], redis_url: str, prefix: str, llm_server: LlmServer, tmp_path: Path
) -> None:
    log = tmp_path / "calls.log"
    scenario = llm_server.scenario(
        [
            calls(
                ("mcp__near__whoami", {}, "c_sync"),
                ("mcp__far__whoami", {}, "c_async"),
                ("mcp__far__image", {}, "c_isolated"),
                ("mcp__near__fail", {"why": "never"}, "c_defer"),
            ),
            text("all four answered"),
        ]
    )
    agent = write_agent(tmp_path, llm_server, scenario, log)
    with Client(settings(redis_url, prefix, tmp_path / "home"), inline=False) as client:
        view = client.start(agent, "use the tools", run=True, timeout=180)
        (deferred,) = wait_for(
            lambda: (p := client.pending(view.session_id)) and all(c.disposition == "defer" for c in p) and p,
            timeout=180,
            what="every call but the deferred one to finish",
        )
        assert (deferred.tool, deferred.reason) == ("mcp__near__fail", "approve it")
        assert "fail" not in log.read_text(), "a deferred call never reaches the server"
        client.complete(deferred.token or "", "approved by hand")
        done = wait_for(
            lambda: (v := client.show(view.session_id)).state == State.COMPLETED and v,
            timeout=120,
            what="the session to complete",
        )
    assert done.response == "all four answered"
    by_id = {c["call_id"]: c for c in done.calls or []}
    assert {k: by_id[k]["disposition"] for k in by_id} == {
        "c_sync": "runSync",
        "c_async": "runAsync",
        "c_isolated": "runIsolated",
        "c_defer": "defer",
    }
    for call in by_id.values():
        assert call["state"] == "completed", (call["call_id"], call["error"], call["meta"])
    steps, tools = workers["steps"], workers["tools,isolated"]
    near, far = by_id["c_sync"]["result"], by_id["c_async"]["result"]
    assert runs_under(near["ppid"], steps) and not runs_under(near["ppid"], tools), "runSync: the step's worker"
    assert runs_under(far["ppid"], tools) and not runs_under(far["ppid"], steps), "runAsync: the tools worker"
    assert near["meta"]["celery-agents/idempotencyKey"].startswith(view.session_id)
    assert by_id["c_isolated"]["meta"]["isolation"] in ("bwrap", "rlimits")
    answers = tool_messages(llm_server.requests[scenario][-1])
    assert answers["c_defer"] == "approved by hand"
    assert answers["c_isolated"].startswith("attached: image/png")
    assert json.loads(answers["c_async"])["pid"] == far["pid"]
    media_message = llm_server.requests[scenario][-1]["messages"][-1]
    assert any(p.get("type") == "image_url" for p in media_message["content"]), "the model got the image"


def test_a_killed_server_is_restarted_and_a_hung_call_is_cut_off_at_its_timeout(
    workers: dict[str, Worker], redis_url: str, prefix: str, llm_server: LlmServer, tmp_path: Path
) -> None:
    killed: list[int] = []

    def kill_the_server(body: dict[str, Any]) -> Reply:
        # Between the two calls: the step worker's server dies.
        pid = json.loads(tool_messages(body)["w1"])["pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        killed.append(pid)
        return calls(("mcp__near__whoami", {}, "w2"))

    scenario = llm_server.scenario(
        [
            calls(("mcp__near__whoami", {}, "w1")),
            kill_the_server,
            calls(("mcp__near__sleep", {"seconds": 120}, "hang")),
            text("survived"),
        ]
    )
    agent = write_agent(tmp_path, llm_server, scenario, tmp_path / "calls.log")
    started = time.monotonic()
    with Client(settings(redis_url, prefix, tmp_path / "home"), inline=False) as client:
        view = client.start(agent, "check twice, then wait", run=True, timeout=180)
        assert view.state == State.COMPLETED, view
        by_id = {c["call_id"]: c for c in client.show(view.session_id).calls or []}
    assert time.monotonic() - started < 110, "the hung call did not hold the session for the tool's 120 s"
    assert view.response == "survived"
    first, second = by_id["w1"]["result"]["pid"], by_id["w2"]["result"]["pid"]
    assert killed == [first] and by_id["w2"]["state"] == "completed" and second != first
    hang = by_id["hang"]
    assert hang["state"] == "failed" and hang["meta"].get("timed_out")
    answers = tool_messages(llm_server.requests[scenario][-1])
    assert "did not answer within 3 s" in answers["hang"], "the model saw why the call failed"


def test_the_servers_stop_with_their_worker(
    workers: dict[str, Worker], redis_url: str, prefix: str, llm_server: LlmServer, tmp_path: Path
) -> None:
    scenario = llm_server.scenario([calls(("mcp__near__whoami", {}, "w")), text("ok")])
    agent = write_agent(tmp_path, llm_server, scenario, tmp_path / "calls.log")
    with Client(settings(redis_url, prefix, tmp_path / "home"), inline=False) as client:
        view = client.start(agent, "who are you", run=True, timeout=120)
        (call,) = client.show(view.session_id).calls or []
    pid = call["result"]["pid"]
    assert pid_alive(pid), "the server stays up between calls"
    assert workers["steps"].terminate() == 0
    wait_for(lambda: not pid_alive(pid), timeout=30, what="the worker's MCP server to stop")
