"""SIGKILL the whole worker at each point of a sub-agent call (child created, child committed,
child finished, parent woken); a fresh worker finishes the tree with nothing lost and no second
child: the parent answers with its one child's answer, and no model is asked twice."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from tests.chaos.conftest import Fleet, report
from tests.chaos.invariants import check_tree
from tests.e2e.conftest import record_tool, runs, wait_for
from tests.support.llm_server import LlmServer, Reply, calls, text

pytestmark = pytest.mark.slow

POINTS = ["child_created", "child_committed", "child_finished", "parent_woken"]


def by_turn(first: Reply, then: Any) -> Any:
    """Answers by the conversation's state, so a repeated request would get the same answer."""

    def reply(body: dict[str, Any]) -> Reply:
        return then(body) if body["messages"][-1]["role"] == "tool" else first

    return reply


def last_tool(body: dict[str, Any]) -> str:
    return str(next(m["content"] for m in reversed(body["messages"]) if m["role"] == "tool"))


@pytest.mark.parametrize("point", POINTS)
def test_sigkill_along_a_sub_agent_call(
    point: str, fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    log = tmp_path / "runs.jsonl"
    child_model = llm_server.scenario([by_turn(calls(("look", {"x": 1})), lambda body: text("found it"))])
    write_agent(
        {
            "slug": "helper",
            "model": f"openai/{child_model}",
            "apiBase": llm_server.url,
            "tools": [record_tool("look", log)],
        },
        "helper.json",
    )
    parent_model = llm_server.scenario(
        [by_turn(calls(("prompt_agent_helper", {"prompt": "look"})), lambda body: text(f"boss: {last_tool(body)}"))]
    )
    path = write_agent(
        {"slug": "boss", "model": f"openai/{parent_model}", "apiBase": llm_server.url, "subAgents": ["helper.json"]},
        "boss.json",
    )
    # A running child's call is looked at again after the lost grace: short here, as recovery is the point.
    doomed = fleet.start(AGENTS_FAULT_PAUSE=point, AGENTS_LOST_GRACE="3")
    with Client(chaos_settings, inline=False) as client:
        store = client.store
        sid = client.start(path, "go", run=True, wait=False).session_id
        wait_for(lambda: store.client.get(store.keys.fault(point)), timeout=60, what=f"checkpoint {point}")
        killed_at = time.monotonic()
        doomed.kill()
        fleet.start(AGENTS_LOST_GRACE="3")
        wait_for(lambda: store.header(sid).status.value != "active", timeout=120, what="a fresh worker to finish")
        recovery = time.monotonic() - killed_at
        tree = check_tree(store, sid)
        assert len(tree) == 2, f"one child, not {tree[1:]}"
        assert store.header(sid).response == "boss: found it"
    assert (llm_server.count(parent_model), llm_server.count(child_model)) == (2, 2), "no model is asked twice"
    assert len(runs(log, "look", phase="start")) == 1, "the child's tool ran once"
    report(f"sub-agent {point}", recovery_s=round(recovery, 2))
