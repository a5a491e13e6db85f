"""Conversations and sub-agents on real worker processes, a real Redis and the scripted model
server: a follow-up after completion and one queued while a runAsync call runs; a parent whose
child defers (completed through `XADD <prefix>:completions`); a grandchild; a delegation a person
approves first; cancel of a parent with a running child. The workers are shared by the module."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.model import State
from tests.e2e.conftest import wait_for
from tests.support.llm_server import LlmServer, calls, text

pytestmark = pytest.mark.slow

GATE = Path(__file__).resolve().parents[1] / "support" / "tools" / "gate.py"
PARAMS = {"type": "object", "properties": {"gate": {"type": "string"}}}


def gate_tool(name: str = "wait_gate") -> dict[str, Any]:
    return {
        "name": name,
        "description": "waits for a gate",
        "parameters": PARAMS,
        "command": [sys.executable, str(GATE)],
    }


def agent(slug: str, model: str, api_base: str, **extra: Any) -> dict[str, Any]:
    return {"slug": slug, "model": f"openai/{model}", "apiBase": api_base, **extra}


def last_user(body: dict[str, Any]) -> str:
    return str(next(m["content"] for m in reversed(body["messages"]) if m["role"] == "user"))


def tool_result(body: dict[str, Any]) -> str:
    return str(next(m["content"] for m in reversed(body["messages"]) if m["role"] == "tool"))


@pytest.fixture
def client(workers: Any, module_settings: Settings) -> Any:
    with Client(module_settings) as c:
        yield c


def test_a_follow_up_continues_a_completed_conversation(
    client: Client, llm_server: LlmServer, write_agent: Any
) -> None:
    model = llm_server.scenario([text("Paris is sunny."), lambda body: text(f"You asked: {last_user(body)}")])
    path = write_agent(agent("chat", model, llm_server.url))
    first = client.start(path, "Weather in Paris?", run=True, timeout=60)
    assert (first.state, first.response) == (State.COMPLETED, "Paris is sunny.")

    second = client.send(first.session_id, "And tomorrow?", run=True, timeout=60)
    assert (second.state, second.response) == (State.COMPLETED, "You asked: And tomorrow?")
    roles = [m["role"] for m in llm_server.requests[model][-1]["messages"]]
    assert roles == ["user", "assistant", "user"], "the whole conversation goes to the model"


def test_a_message_sent_during_a_run_async_call_follows_its_result(
    client: Client, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    model = llm_server.scenario([calls(("wait_gate", {"gate": str(gate)})), text("done")])
    policy = {"default": "runSync", "rules": [{"tool": "wait_gate", "disposition": "runAsync"}]}
    path = write_agent(agent("queued", model, llm_server.url, tools=[gate_tool()], toolCallPolicy=policy))
    view = client.start(path, "Open the gate.", run=True, wait=False)
    wait_for(lambda: Path(f"{gate}.started").exists(), 60, "the runAsync call to start")

    waiting = client.send(view.session_id, "Also say hello.")
    assert waiting.state in (State.WAITING, State.RUNNING) and len(waiting.pending) == 1
    gate.touch()
    wait_for(lambda: client.view(view.session_id).state == State.COMPLETED, 60, "the session to complete")

    messages = llm_server.requests[model][-1]["messages"]
    assert [m["role"] for m in messages][-3:] == ["assistant", "tool", "user"]
    assert messages[-1]["content"] == "Also say hello." and "opened" in messages[-2]["content"]


def boss_and_helper(llm_server: LlmServer, write_agent: Any, helper: dict[str, Any], **boss: Any) -> tuple[Path, str]:
    """helper.json as given, and boss.json delegating to it once and saying what it answered."""
    write_agent(helper, "helper.json")
    model = llm_server.scenario(
        [
            calls(("prompt_agent_helper", {"prompt": "find the capital of France"})),
            lambda body: text(f"The helper said: {tool_result(body)}"),
        ]
    )
    return write_agent(agent("boss", model, llm_server.url, subAgents=["helper.json"], **boss), "boss.json"), model


def test_a_child_that_defers_is_completed_through_the_stream_and_wakes_its_parent(
    client: Client, llm_server: LlmServer, write_agent: Any, module_settings: Settings
) -> None:
    child_model = llm_server.scenario([calls(("approve", {})), lambda body: text(f"Paris ({tool_result(body)})")])
    approve = {
        "name": "approve",
        "description": "a person approves",
        "parameters": {"type": "object"},
        "external": True,
    }
    helper = agent("helper", child_model, llm_server.url, description="Finds things out.", tools=[approve])
    path, _ = boss_and_helper(llm_server, write_agent, helper)

    parent = client.start(path, "What is the capital of France?", run=True, timeout=60)
    assert parent.state == State.WAITING and len(parent.children) == 1, parent
    child_id = parent.children[0]
    child = client.view(child_id)
    assert (child.parent, child.state) == (parent.session_id, State.WAITING)
    pending = client.pending(parent.session_id)
    deferred = [p for p in pending if p.token]
    assert [(p.session_id, p.tool) for p in deferred] == [(child_id, "approve")], pending

    store = client.store
    store.client.xadd(store.keys.completions, {"token": deferred[0].token or "", "result": "approved"})
    wait_for(lambda: client.view(parent.session_id).state == State.COMPLETED, 60, "the parent to complete")
    assert client.view(parent.session_id).response == "The helper said: Paris (approved)"
    assert client.view(child_id).state == State.COMPLETED


def test_a_child_can_delegate_to_a_grandchild(client: Client, llm_server: LlmServer, write_agent: Any) -> None:
    write_agent(agent("scout", llm_server.scenario([text("scout found it")]), llm_server.url), "scout.json")
    helper_model = llm_server.scenario(
        [calls(("prompt_agent_scout", {"prompt": "look"})), lambda body: text(f"helper: {tool_result(body)}")]
    )
    helper = agent("helper", helper_model, llm_server.url, subAgents=["scout.json"])
    path, _ = boss_and_helper(llm_server, write_agent, helper)

    parent = client.start(path, "Go.", run=True, timeout=90)
    assert (parent.state, parent.response) == (State.COMPLETED, "The helper said: helper: scout found it")
    child = client.view(parent.children[0])
    grandchild = client.view(child.children[0])
    assert (child.parent, grandchild.parent, grandchild.children) == (parent.session_id, child.session_id, [])
    assert grandchild.response == "scout found it"


def test_a_delegation_a_rule_defers_starts_its_child_once_approved(
    client: Client, llm_server: LlmServer, write_agent: Any
) -> None:
    helper = agent("helper", llm_server.scenario([text("Paris")]), llm_server.url)
    rule = {"tool": "prompt_agent_helper", "disposition": {"tag": "defer", "reason": "a person approves delegation"}}
    path, _ = boss_and_helper(llm_server, write_agent, helper, toolCallPolicy={"default": "runSync", "rules": [rule]})
    parent = client.start(path, "Capital?", run=True, timeout=60)
    assert parent.state == State.WAITING and parent.children == [], "no child before the approval"
    (call,) = parent.pending
    assert (call.tool, call.reason, call.arguments) == (
        "prompt_agent_helper",
        "a person approves delegation",
        {"prompt": "find the capital of France"},
    )
    done = client.approve(call.token or "", digest=call.digest, by="alice")
    assert done.accepted and done.remaining == 1 and done.decision == "approved", "the call goes on: as the child"
    wait_for(lambda: client.view(parent.session_id).state == State.COMPLETED, 60, "the parent to complete")
    view = client.view(parent.session_id)
    assert view.response == "The helper said: Paris" and len(view.children) == 1


def test_cancelling_a_parent_cancels_its_running_child(
    client: Client, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    child_model = llm_server.scenario([calls(("wait_gate", {"gate": str(gate)})), text("never")])
    rule = {"default": "runSync", "rules": [{"tool": "wait_gate", "disposition": "runAsync"}]}
    helper = agent("helper", child_model, llm_server.url, tools=[gate_tool()], toolCallPolicy=rule)
    path, _ = boss_and_helper(llm_server, write_agent, helper)
    parent = client.start(path, "Go.", run=True, wait=False)
    wait_for(lambda: Path(f"{gate}.started").exists(), 60, "the child's tool to start")
    (child_id,) = client.view(parent.session_id).children

    cancelled = client.cancel(parent.session_id)
    assert cancelled.state == State.CANCELLED
    child = client.view(child_id)
    assert (child.state, child.pending) == (State.CANCELLED, [])
    gate.touch()
    assert client.pending(parent.session_id) == []
