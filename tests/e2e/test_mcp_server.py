"""`agents mcp-server` driven by the MCP SDK's own client over stdio: a whole start -> pending ->
complete -> completed flow, with a real worker (and, separately, on the embedded local default
with no worker at all)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import start_workers
from tests.support.llm_server import LlmServer, calls, text
from tests.support.workers import stop_all, worker_env

pytestmark = pytest.mark.slow


def payment_agent(folder: Path, llm_server: LlmServer, scenario: str) -> Path:
    path = folder / "pay.json"
    path.write_text(
        json.dumps(
            {
                "slug": "payer",
                "model": f"openai/{scenario}",
                "apiBase": llm_server.url,
                "tools": [
                    {
                        "name": "approve_payment",
                        "description": "A person approves a payment",
                        "parameters": {"type": "object", "properties": {"amount": {"type": "number"}}},
                        "external": True,
                    }
                ],
            }
        )
    )
    return path


async def drive(env: dict[str, str], agent: Path) -> dict[str, Any]:
    """The whole flow through the MCP server; returns what each tool answered."""
    from mcp import Client, StdioServerParameters

    params = StdioServerParameters(command=sys.executable, args=["-m", "celery_agents.cli", "mcp-server"], env=env)
    seen: dict[str, Any] = {}
    async with Client(params, cache=None) as client:
        listed = {t.name for t in (await client.list_tools()).tools}
        assert listed == {"start_session", "session_status", "pending", "complete", "approve", "reject"}
        started = await client.call_tool("start_session", {"agent_file": str(agent), "prompt": "pay 12 EUR"})
        assert not started.is_error, started.content
        view = seen["start"] = started.structured_content
        sid = view["session_id"]
        pending = (await client.call_tool("pending", {"session_id": sid})).structured_content
        seen["pending"] = pending
        (call,) = pending["pending"]
        done = await client.call_tool("complete", {"token": call["token"], "result": {"approved": True}, "by": "mcp"})
        seen["complete"] = done.structured_content
        again = await client.call_tool("complete", {"token": call["token"], "result": "twice"})
        seen["again"] = (again.is_error, again.content[0].text)  # type: ignore[union-attr]
        for _ in range(600):
            status = (await client.call_tool("session_status", {"session_id": sid})).structured_content
            if status["state"] in ("completed", "failed", "cancelled"):
                break
            await asyncio.sleep(0.1)
        seen["status"] = status
        unknown = await client.call_tool("session_status", {"session_id": "nope"})
        seen["unknown"] = (unknown.is_error, unknown.content[0].text)  # type: ignore[union-attr]
    return seen


def check(seen: dict[str, Any], llm_server: LlmServer, scenario: str) -> None:
    assert seen["start"]["state"] == "waiting"
    (call,) = seen["pending"]["pending"]
    assert (call["tool"], call["arguments"], call["disposition"]) == ("approve_payment", {"amount": 12}, "defer")
    assert seen["complete"]["accepted"] is True and seen["complete"]["remaining"] == 0
    assert seen["again"][0] and "token_already_completed" in seen["again"][1]
    assert (seen["status"]["state"], seen["status"]["response"]) == ("completed", "paid 12 EUR")
    assert seen["unknown"][0] and "unknown_session" in seen["unknown"][1]
    answers = [m["content"] for m in llm_server.requests[scenario][-1]["messages"] if m["role"] == "tool"]
    assert json.loads(answers[0]) == {"approved": True}, "the model got the completion"


def test_mcp_server_with_a_worker(redis_url: str, llm_server: LlmServer, tmp_path: Path) -> None:
    prefix = f"s{uuid.uuid4().hex[:10]}"
    scenario = llm_server.scenario([calls(("approve_payment", {"amount": 12})), text("paid 12 EUR")])
    agent = payment_agent(tmp_path, llm_server, scenario)
    workers = start_workers(redis_url, prefix, tmp_path, queues="steps")
    try:
        seen = asyncio.run(drive(worker_env(redis_url, prefix), agent))
    finally:
        stop_all(workers)
    check(seen, llm_server, scenario)


def test_mcp_server_on_the_embedded_default_with_no_worker(llm_server: LlmServer, tmp_path: Path) -> None:
    scenario = llm_server.scenario([calls(("approve_payment", {"amount": 12})), text("paid 12 EUR")])
    agent = payment_agent(tmp_path, llm_server, scenario)
    env = worker_env(None, "agents", home=tmp_path / "home")
    assert "AGENTS_REDIS_URL" not in env and os.environ.get("AGENTS_REDIS_URL") is None
    seen = asyncio.run(drive(env, agent))
    check(seen, llm_server, scenario)


def test_agents_run_on_the_embedded_default_lists_and_calls_mcp_servers(llm_server: LlmServer, tmp_path: Path) -> None:
    """No Redis URL, no worker: the CLI lists the servers, runs the calls itself (runSync inline,
    runAsync dispatched to itself), and leaves no server running when it exits."""
    import subprocess

    from tests.tools.mcp.conftest import SAMPLE, TIME_SERVER

    scenario = llm_server.scenario(
        [
            calls(("mcp__sample__add", {"a": 20, "b": 22}), ("mcp__time__get_current_time", {"timezone": "UTC"})),
            text("42, at some time"),
        ]
    )
    agent = tmp_path / "local.json"
    log = tmp_path / "calls.log"
    agent.write_text(
        json.dumps(
            {
                "slug": "local-mcp",
                "model": f"openai/{scenario}",
                "apiBase": llm_server.url,
                "mcpServers": {
                    "sample": {"command": sys.executable, "args": [str(SAMPLE)], "env": {"CALL_LOG": str(log)}},
                    "time": {"command": TIME_SERVER},
                },
                "toolCallPolicy": {"rules": [{"tool": "mcp__time__*", "disposition": "runAsync"}]},
            }
        )
    )
    env = worker_env(None, "agents", home=tmp_path / "home")
    done = subprocess.run(
        [sys.executable, "-m", "celery_agents.cli", "run", "--agent-file", str(agent), "-p", "add", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    assert (view["state"], view["response"]) == ("completed", "42, at some time")
    answers = [m["content"] for m in llm_server.requests[scenario][-1]["messages"] if m["role"] == "tool"]
    assert json.loads(answers[0]) == {"result": 42} and json.loads(answers[1])["timezone"] == "UTC"
    (line,) = log.read_text().splitlines()
    server_pid = int(line.split()[1])
    from tests.support.workers import pid_alive

    assert not pid_alive(server_pid), "the CLI stopped the server it started"
