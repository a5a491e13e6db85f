"""SIGKILL the whole worker (its process group) at the worst moments; a fresh worker must finish
every session with nothing lost, duplicated or redone that was already done. The model's answer
travels in the step's commit: killed after the model answered and before the commit, the step
asks the model once more; killed after the commit, never again."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from tests.chaos.conftest import Fleet, report
from tests.chaos.invariants import check_invariants
from tests.e2e.conftest import record_tool, runs, wait_for
from tests.support.llm_server import LlmServer, Reply, calls, text

pytestmark = pytest.mark.slow


def conversation(delay_first: float = 0.0, sync_sleep: float = 0.0, async_sleep: float = 0.0) -> Any:
    """Answers by the conversation's state, so a repeated request gets the same answer."""
    state = {"n": 0}

    def reply(body: dict[str, Any]) -> Reply:
        state["n"] += 1
        if body["messages"][-1]["role"] == "tool":
            return text("done")
        r = calls(("sync_tool", {"x": 1, "sleep": sync_sleep}), ("async_tool", {"x": 2, "sleep": async_sleep}))
        r.delay = delay_first if state["n"] == 1 else 0.0
        return r

    return reply


def agent(scenario: str, url: str, log: Path) -> dict[str, Any]:
    return {
        "slug": "chaos",
        "model": f"openai/{scenario}",
        "apiBase": url,
        "tools": [record_tool("sync_tool", log), record_tool("async_tool", log)],
        "toolCallPolicy": {"default": "runSync", "rules": [{"tool": "async_tool", "disposition": "runAsync"}]},
    }


CASES = {
    # name: (conversation kwargs, worker env, what to wait for before the kill, model requests expected)
    "during_llm_call": ({"delay_first": 30}, {}, "llm", 3),
    "during_runsync_tool": ({"sync_sleep": 3}, {}, "sync_tool", 2),
    "during_runasync_tool": ({"async_sleep": 3}, {}, "async_tool", 2),
    # the answer of the first model call was not committed: asked once more, then once after the tools
    "after_llm_answered": ({}, {"AGENTS_FAULT_PAUSE": "after_llm"}, "fault:after_llm", 3),
    "after_commit": ({}, {"AGENTS_FAULT_PAUSE": "after_commit"}, "fault:after_commit", 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sigkill_whole_worker(
    case: str, fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    kwargs, env, kill_at, expected_requests = CASES[case]
    log = tmp_path / "runs.jsonl"
    scenario = llm_server.scenario([conversation(**kwargs)])
    path = write_agent(agent(scenario, llm_server.url, log))
    doomed = fleet.start(**env)
    with Client(chaos_settings, inline=False) as client:
        store = client.store
        sid = client.start(path, "go", run=True, wait=False).session_id
        if kill_at == "llm":
            wait_for(lambda: llm_server.count(scenario) == 1, what="the model call to start")
        elif kill_at.startswith("fault:"):
            wait_for(lambda: store.client.get(store.keys.fault(kill_at[6:])) == sid, what=f"checkpoint {kill_at}")
        else:
            wait_for(lambda: runs(log, kill_at, phase="start"), what=f"{kill_at} to start")
        killed_at = time.monotonic()
        doomed.kill()
        fleet.start()
        wait_for(lambda: store.header(sid).status.value != "active", timeout=90, what="a fresh worker to finish")
        recovery = time.monotonic() - killed_at
        check_invariants(store, sid)
        assert store.header(sid).response == "done"
        answers = store.turns(sid)[2].tool_responses
        assert [a.tool for a in answers] == ["sync_tool", "async_tool"]
    assert llm_server.count(scenario) == expected_requests, "a committed model response is never requested again"
    starts = {t: runs(log, t, phase="start") for t in ("sync_tool", "async_tool")}
    for tool, rows in starts.items():
        interrupted = kill_at == tool
        assert len(rows) == (2 if interrupted else 1), f"{tool} ran {len(rows)} times"
        assert len({r["key"] for r in rows}) == 1, "a re-run keeps the idempotency key"
    report(case, recovery_s=round(recovery, 2), model_requests=llm_server.count(scenario))


def test_an_approved_gate_killed_while_it_runs_completes_once_and_never_runs_before_its_decision(
    fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    log = tmp_path / "runs.jsonl"

    def reply(body: dict[str, Any]) -> Reply:
        if body["messages"][-1]["role"] == "tool":
            return text("done")
        return calls(("pay", {"x": 7, "sleep": 3}))

    scenario = llm_server.scenario([reply])
    gate = {"tag": "defer", "then": "runAsync", "reason": "a payment"}
    path = write_agent(
        {
            "slug": "gated-chaos",
            "model": f"openai/{scenario}",
            "apiBase": llm_server.url,
            "tools": [record_tool("pay", log)],
            "toolCallPolicy": {"default": "runSync", "rules": [{"tool": "pay", "disposition": gate}]},
        }
    )
    doomed = fleet.start()
    with Client(chaos_settings, inline=False) as client:
        store = client.store
        view = client.start(path, "go", run=True, timeout=60)
        (pending,) = view.pending
        assert pending.kind == "approval" and runs(log, phase="start") == [], "nothing runs before its decision"
        client.approve(pending.token or "", digest=pending.digest, by="chaos")
        wait_for(lambda: runs(log, "pay", phase="start"), what="the approved call to start")
        doomed.kill()
        fleet.start()
        wait_for(lambda: store.header(view.session_id).status.value != "active", timeout=90, what="the session")
        check_invariants(store, view.session_id)
        assert store.header(view.session_id).response == "done"
        answers = store.turns(view.session_id)[2].tool_responses
        assert [a.call_id for a in answers] == [pending.call_id], "one result, recorded once"
    # Run again by the fresh worker, under the same idempotency key (a tool dedupes by it; the first
    # run's process may even finish on its own after its worker died, as for any runAsync call).
    starts = runs(log, "pay", phase="start")
    assert len(starts) == 2 and {r["key"] for r in starts} == {r["key"] for r in runs(log, "pay")}
    assert len({r["key"] for r in starts}) == 1 and starts[0]["args"] == {"x": 7, "sleep": 3}


@pytest.mark.parametrize("kill_at", ["during_llm_call", "after_llm_answered"])
def test_a_model_call_lost_with_its_worker_counts_against_the_budget(
    kill_at: str, fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    """A session may make two model calls. Its worker dies while the first is made, or after it
    answered and before the step's commit: the provider was asked (and charges) but the answer is
    lost, so the step asks again. That was the second call: the model is never asked a third time,
    and the session ends `budget_exceeded` with the two calls the provider saw as its spend."""
    during = kill_at == "during_llm_call"
    log = tmp_path / "runs.jsonl"
    scenario = llm_server.scenario([conversation(delay_first=30 if during else 0)])
    path = write_agent({**agent(scenario, llm_server.url, log), "budget": {"modelCalls": 2}})
    doomed = fleet.start(**({} if during else {"AGENTS_FAULT_PAUSE": "after_llm"}))
    with Client(chaos_settings, inline=False) as client:
        store = client.store
        sid = client.start(path, "go", run=True, wait=False).session_id
        if during:
            wait_for(lambda: llm_server.count(scenario) == 1, what="the model call to start")
        else:
            wait_for(lambda: store.client.get(store.keys.fault("after_llm")) == sid, what="the model to answer")
        doomed.kill()
        fleet.start()
        wait_for(lambda: store.header(sid).status.value != "active", timeout=90, what="a fresh worker to end it")
        header = store.header(sid)
        assert header.error is not None and header.error.code == "budget_exceeded", header.error
        assert "modelCalls spent 2, limit 2" in header.error.message
        assert header.spent.model_calls == 2
        assert len(store.claims_held(sid)) == 0
    assert llm_server.count(scenario) == 2, "the provider was asked twice: the lost call and the one that replaced it"
    assert len(runs(log, "sync_tool", phase="start")) == 1, "the tools the second answer asked for ran"
