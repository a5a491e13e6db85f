"""The seed's flow on real worker processes, a real Redis and a scripted model reached by litellm
through `apiBase`; and duplicate / racing deliveries of one step message."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.store import Store
from tests.e2e.conftest import record_tool, runs, wait_for
from tests.support.llm_server import LlmServer, Reply, calls, text

pytestmark = pytest.mark.slow


def three_tool_agent(model: str, api_base: str, log: Path, **extra: Any) -> dict[str, Any]:
    return {
        "slug": "seed-flow",
        "model": f"openai/{model}",
        "apiBase": api_base,
        "tools": [
            record_tool("sync_tool", log),
            record_tool("async_tool", log),
            {
                "name": "approve",
                "description": "a person approves",
                "external": True,
                "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
            },
        ],
        "toolCallPolicy": {
            "default": "runSync",
            "rules": [
                {"tool": "async_tool", "disposition": "runAsync"},
                {"tool": "approve", "disposition": {"tag": "defer", "reason": "approval required"}},
            ],
        },
        **extra,
    }


def seed_script() -> list[Reply]:
    return [calls(("sync_tool", {"x": 1}), ("async_tool", {"x": 2}), ("approve", {"x": 3})), text("all three answered")]


def tool_messages(request: dict[str, Any]) -> list[tuple[str, str]]:
    return [(m["tool_call_id"], m["content"]) for m in request["messages"] if m["role"] == "tool"]


def test_seed_flow_step_by_step(
    workers: Any, module_settings: Settings, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    log = tmp_path / "runs.jsonl"
    scenario = llm_server.scenario(seed_script())
    agent = write_agent(three_tool_agent(scenario, llm_server.url, log))
    with Client(module_settings, inline=False) as client:
        view = client.start(agent, "use all three tools")
        assert (view.state.value, view.head, view.version) == ("ready", "UserTurn", 1)
        assert llm_server.count(f"{scenario}") == 0, "start must not call the model"

        view = client.step(view.session_id, timeout=30)
        assert (view.state.value, view.head) == ("tools", "LlmTurn")
        assert llm_server.count(scenario) == 1

        view = client.step(view.session_id, timeout=30)
        assert view.head == "PartialUserTurn"
        assert [r["tool"] for r in runs(log)][:1] == ["sync_tool"]
        sid = view.session_id
        pending = wait_for(
            lambda: [p for p in client.pending(sid)] if [p.tool for p in client.pending(sid)] == ["approve"] else None,
            what="the async tool to finish",
        )
        (deferred,) = pending
        assert deferred.disposition == "defer" and deferred.reason == "approval required" and deferred.token
        assert deferred.arguments == {"x": 3}

        done = client.complete(deferred.token, {"approved": True}, by="tester")
        assert (done.accepted, done.remaining, done.woken) == (True, 0, False)

        view = client.step(sid, timeout=30)
        assert view.state.value == "completed" and view.response == "all three answered"

    assert llm_server.count(scenario) == 2
    last = llm_server.requests[scenario][-1]
    answers = tool_messages(last)
    assert [cid for cid, _ in answers] == ["call_0_0", "call_0_1", "call_0_2"]
    assert json.loads(answers[0][1])["tool"] == "sync_tool"
    assert json.loads(answers[1][1])["tool"] == "async_tool"
    assert json.loads(answers[2][1]) == {"approved": True}
    assert sorted(r["tool"] for r in runs(log)) == ["async_tool", "sync_tool"], "each tool ran exactly once"


def test_auto_drive_resumes_by_itself_after_completion(
    workers: Any, module_settings: Settings, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    log = tmp_path / "runs.jsonl"
    scenario = llm_server.scenario(seed_script())
    agent = write_agent(three_tool_agent(scenario, llm_server.url, log))
    with Client(module_settings, inline=False) as client:
        view = client.start(agent, "go", run=True, timeout=30)
        assert view.state.value == "waiting"
        assert [p.tool for p in view.pending] == ["approve"], "only the outside work remains"
        done = client.complete(view.pending[0].token, "approved")
        assert done.woken
        store = client.store
        wait_for(lambda: store.header(view.session_id).state.value == "completed", what="the session to finish")
        assert store.header(view.session_id).response == "all three answered"
    assert llm_server.count(scenario) == 2


def test_same_step_delivered_twice_commits_once(
    workers: Any, module_settings: Settings, llm_server: LlmServer, write_agent: Any
) -> None:
    # The model answers slowly, so both copies are in flight at once on the two workers.
    scenario = llm_server.scenario([text("slow answer", delay=1.0)])
    agent = write_agent({"slug": "dup", "model": f"openai/{scenario}", "apiBase": llm_server.url})
    with Client(module_settings, inline=False) as client:
        sid = client.start(agent, "hello").session_id
        store = client.store
        for _ in range(3):
            client.dispatcher.step(sid, 1)
        wait_for(lambda: store.header(sid).state.value == "completed", what="the step to commit")
        # Every copy has finished one way or another: two skip events and one commit.
        wait_for(
            lambda: len([e for e in store.read_events(sid) if e["type"] == "step_skipped"]) == 2,
            what="the two other copies to be skipped",
        )
        events = store.read_events(sid)
        assert [e["type"] for e in events].count("step_committed") == 1
        assert store.header(sid).version == 2
        assert len(store.turns(sid)) == 2
    assert llm_server.count(scenario) == 1, "the model was called once"


def test_stale_copy_after_commit_does_nothing(
    workers: Any, module_settings: Settings, llm_server: LlmServer, write_agent: Any
) -> None:
    scenario = llm_server.scenario([text("once")])
    agent = write_agent({"slug": "stale", "model": f"openai/{scenario}", "apiBase": llm_server.url})
    with Client(module_settings, inline=False) as client:
        view = client.step(client.start(agent, "hi").session_id, timeout=30)
        assert view.state.value == "completed"
        store: Store = client.store
        before = (store.header(view.session_id).version, len(store.turns(view.session_id)))
        client.dispatcher.step(view.session_id, 1, "late-copy")
        wait_for(
            lambda: any(e.get("request") == "late-copy" for e in store.read_events(view.session_id)),
            what="the late copy to be seen",
        )
        skipped = [e for e in store.read_events(view.session_id) if e.get("request") == "late-copy"]
        assert skipped[0]["type"] == "step_skipped" and skipped[0]["reason"] in ("stale", "completed")
        assert (store.header(view.session_id).version, len(store.turns(view.session_id))) == before
    assert llm_server.count(scenario) == 1
