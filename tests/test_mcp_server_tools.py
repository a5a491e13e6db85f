"""The tools of `agents mcp-server`, through the SDK's in-process client: the agent may be given as
an object, refusals name the contract's error codes, and the documents are the CLI's; approval
gates are approved (with an edit, bound to the digest) and rejected, and the tool runs exactly as
decided."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.mcp_server import SessionTools, build_server
from celery_agents.model import State
from celery_agents.tools.resolve import parse_agent
from tests.e2e.conftest import record_tool, runs
from tests.scheduler.fakes import ScriptedLlm, llm_turn


def call(settings: Settings, tool: str, arguments: dict[str, Any]) -> tuple[bool, Any]:
    with Client(settings, inline=False) as client:
        return call_on(client, tool, arguments)


def call_on(client: Client, tool: str, arguments: dict[str, Any]) -> tuple[bool, Any]:
    from mcp import Client as McpClient

    async def once() -> tuple[bool, Any]:
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


def test_refusals_begin_with_the_contracts_error_code(settings: Settings) -> None:
    failed, text = call(settings, "complete", {"token": "nope.nope", "result": "x"})
    assert failed and text.startswith("unknown_token: "), text
    failed, text = call(settings, "complete", {"token": "nope.nope", "result": "x", "error": "y"})
    assert failed and text.startswith("invalid_input: "), text
    failed, text = call(settings, "start_session", {"prompt": "hi"})
    assert failed and text.startswith("invalid_input: ") and "agent_file" in text
    failed, text = call(settings, "start_session", {"agent": {"slug": "x"}, "prompt": "hi", "run": False})
    assert failed and text.startswith("invalid_agent_file: ") and "model" in text


def test_arguments_that_do_not_fit_a_tool_are_invalid_input_naming_the_field(settings: Settings) -> None:
    failed, text = call(settings, "start_session", {"agent": [], "prompt": "hi", "run": False})
    assert failed and text.startswith("invalid_input: ") and "agent" in text, text
    assert "pydantic" not in text, "no library's wording or links"
    failed, text = call(settings, "session_status", {"session_id": {"$gt": ""}})
    assert failed and text.startswith("invalid_input: ") and "session_id" in text, text


def test_what_an_mcp_client_sends_is_bounded_as_the_cli_bounds_it(settings: Settings) -> None:
    big = "x" * (settings.max_prompt_bytes + 1)
    failed, text = call(settings, "start_session", {"agent": {"slug": "a", "model": "openai/none"}, "prompt": big})
    assert failed and text.startswith("invalid_input: ") and "AGENTS_MAX_PROMPT_BYTES" in text
    failed, text = call(settings, "complete", {"token": "nope.nope", "result": "y" * (settings.max_result_bytes + 1)})
    assert failed and text.startswith("invalid_result: ") and "AGENTS_MAX_RESULT_BYTES" in text


def test_gates_are_approved_with_an_edit_and_rejected_and_the_tool_runs_exactly_as_decided(
    settings: Settings, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    parameters = {"type": "object", "properties": {"amount": {"type": "number"}}, "required": ["amount"]}
    agent = parse_agent(
        {
            "slug": "payer",
            "model": "fake/model",
            "tools": [{**record_tool("pay", log), "parameters": parameters}, record_tool("note", log)],
            "toolCallPolicy": {
                "default": "runSync",
                "rules": [
                    {"tool": "pay", "disposition": {"tag": "defer", "then": "runSync", "reason": "a payment"}},
                    {"tool": "note", "disposition": {"tag": "defer"}},
                ],
            },
        }
    )
    asked = [("c1", "pay", '{"amount": 500}'), ("c2", "pay", '{"amount": 700}'), ("n1", "note", "{}")]
    llm = ScriptedLlm(llm_turn(*asked), llm_turn(text="one paid, one refused"))
    with Client(settings, inline=True, llm=llm) as client:
        sid = client.start(agent, "pay", run=True).session_id
        failed, listed = call_on(client, "pending", {"session_id": sid})
        gates = {p["call_id"]: p for p in listed["pending"]}
        first, second, note = gates["c1"], gates["c2"], gates["n1"]
        assert (first["kind"], first["then"], note["kind"]) == ("approval", "runSync", "result")

        failed, text = call_on(client, "approve", {"token": first["token"], "digest": second["digest"]})
        assert failed and text.startswith("digest_mismatch: "), text
        failed, text = call_on(client, "approve", {"token": first["token"], "arguments": {"amount": "lots"}})
        assert failed and text.startswith("invalid_arguments: ") and "amount" in text, text
        failed, text = call_on(client, "approve", {"token": note["token"]})
        assert failed and text.startswith("not_an_approval: "), text
        failed, text = call_on(client, "reject", {"token": note["token"]})
        assert failed and text.startswith("not_an_approval: "), text
        assert runs(log, phase="start") == [], "nothing ran, nothing changed"

        edit = {"token": first["token"], "arguments": {"amount": 90}, "digest": first["digest"], "by": "assistant"}
        failed, done = call_on(client, "approve", edit)
        assert not failed and (done["decision"], done["call_id"]) == ("edited", "c1"), done
        failed, text = call_on(client, "reject", {"token": second["token"], "digest": first["digest"]})
        assert failed and text.startswith("digest_mismatch: "), "a rejection is bound to what was shown too"
        rejection = {"token": second["token"], "reason": "twice is too much", "digest": second["digest"]}
        failed, done = call_on(client, "reject", rejection)
        assert not failed and done["decision"] == "rejected", done
        failed, text = call_on(client, "approve", {"token": first["token"]})
        assert failed and text.startswith("token_already_completed: "), text
        assert not call_on(client, "complete", {"token": note["token"], "result": "noted"})[0]
        final = client.view(sid)
    assert (final.state, final.response) == (State.COMPLETED, "one paid, one refused")
    assert [r["args"] for r in runs(log, "pay", "start")] == [{"amount": 90}], "exactly the edited call, once"
    told = {m.get("tool_call_id"): str(m["content"]) for m in llm.requests[-1].messages if m.get("role") == "tool"}
    assert json.loads(told["c1"])["echo"] == {"amount": 90} and "rejected: twice is too much" in told["c2"]
