"""The tools of `agents mcp-server`, through the SDK's in-process client: the agent may be given as
an object, refusals name the contract's error codes, and the documents are the CLI's."""

from __future__ import annotations

import asyncio
from typing import Any

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.mcp_server import SessionTools, build_server


def call(settings: Settings, tool: str, arguments: dict[str, Any]) -> tuple[bool, Any]:
    from mcp import Client as McpClient

    async def once() -> tuple[bool, Any]:
        with Client(settings, inline=False) as client:
            async with McpClient(build_server(SessionTools(client, 5.0)), cache=None) as mcp:
                res = await mcp.call_tool(tool, arguments)
                return res.is_error, res.structured_content if not res.is_error else res.content[0].text  # type: ignore[union-attr]

    return asyncio.run(once())


def test_start_session_takes_the_agent_as_an_object_and_the_view_comes_back(settings: Settings) -> None:
    agent = {"slug": "obj", "model": "openai/none"}
    failed, view = call(settings, "start_session", {"agent": agent, "prompt": "hello", "run": False})
    assert not failed and (view["state"], view["head"], view["version"]) == ("ready", "UserTurn", 1)
    failed, status = call(settings, "session_status", {"session_id": view["session_id"][:12]})
    assert not failed and status["session_id"] == view["session_id"], "a unique prefix is accepted"
    failed, pending = call(settings, "pending", {"session_id": view["session_id"]})
    assert (failed, pending) == (False, {"pending": []})


def test_refusals_name_the_contracts_error_codes(settings: Settings) -> None:
    failed, text = call(settings, "complete", {"token": "nope.nope", "result": "x"})
    assert failed and "unknown_token" in text
    failed, text = call(settings, "complete", {"token": "nope.nope", "result": "x", "error": "y"})
    assert failed and "invalid_input" in text
    failed, text = call(settings, "start_session", {"prompt": "hi"})
    assert failed and "invalid_input" in text and "agent_file" in text
    failed, text = call(settings, "start_session", {"agent": {"slug": "x"}, "prompt": "hi", "run": False})
    assert failed and "invalid_agent_file" in text and "model" in text
