"""Approval gates on real workers: an approved gate runs under its `then` as any call of that
disposition does — in the sandbox for `runIsolated`, with the object form's own timeout and
retries — and its result reaches the model; a gate nobody decides expires on the worker's sweeper,
the tool never runs and the model is told `expired:`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.model import State
from tests.e2e.conftest import record_tool, runs, start_workers, wait_for
from tests.support.llm_server import LlmServer, calls, text
from tests.support.workers import Worker, stop_all
from tests.tools.conftest import PY, write_program

#: in the worker's environment, never in a sandboxed tool's
SECRET = "gate-secret-3f9c"

#: what a runIsolated tool sees: the worker's secret, a connection to the model server, its uid
PROBE = """
import json, os, socket, sys
host, port = sys.argv[1], int(sys.argv[2])
try:
    socket.create_connection((host, port), timeout=3).close()
    network = True
except OSError:
    network = False
print(json.dumps({"secret": "GATE_SECRET" in os.environ, "network": network, "uid": os.getuid(),
                  "session": os.environ.get("AGENTS_SESSION_ID")}))
"""

#: fails with EX_TEMPFAIL (worth a retry) until its third run, counting runs in argv[1]
FLAKY = """
import json, sys
from pathlib import Path
count = Path(sys.argv[1])
n = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(n))
if n < 3:
    print(f"busy ({n})", file=sys.stderr)
    sys.exit(75)
print(json.dumps({"ran": n}))
"""


@pytest.fixture(scope="module")
def fleet(redis_url: str, module_prefix: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Worker]]:
    """One worker serving every lane, with a secret in its environment."""
    ws = start_workers(redis_url, module_prefix, tmp_path_factory.mktemp("logs"), GATE_SECRET=SECRET)
    yield ws
    stop_all(ws)


def told(llm_server: LlmServer, scenario: str) -> dict[str, str]:
    """What the model's last request said of each call: call id -> the tool message's content."""
    last = llm_server.requests[scenario][-1]
    return {m["tool_call_id"]: m["content"] for m in last["messages"] if m["role"] == "tool"}


def gated(model: str, api_base: str, tools: list[dict[str, Any]], rules: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "slug": "gated",
        "model": f"openai/{model}",
        "apiBase": api_base,
        "tools": tools,
        "toolCallPolicy": {"default": "runSync", "rules": rules},
    }


def test_an_approved_isolated_gate_runs_once_in_the_sandbox_and_the_model_gets_its_result(
    fleet: Any, module_settings: Settings, llm_server: LlmServer, write_agent: Any, tooldir: Path
) -> None:
    write_program(tooldir, "probe.py", PROBE)
    model = urlparse(llm_server.url)
    probe = {
        "name": "probe",
        "description": "what the tool can reach",
        "command": [PY, str(tooldir / "probe.py"), model.hostname or "127.0.0.1", str(model.port)],
    }
    rule = {"tool": "probe", "disposition": {"tag": "defer", "then": "runIsolated", "reason": "look around"}}
    scenario = llm_server.scenario([calls(("probe", {})), text("looked")])
    path = write_agent(gated(scenario, llm_server.url, [probe], [rule]))
    with Client(module_settings, inline=False) as client:
        waiting = client.start(path, "look", run=True, timeout=60)
        (gate,) = waiting.pending
        assert (waiting.state, gate.kind, gate.then) == (State.WAITING, "approval", "runIsolated")
        assert client.approve(gate.token or "", digest=gate.digest, by="alice").decision == "approved"
        wait_for(lambda: client.view(waiting.session_id).state == State.COMPLETED, 60, "the session to complete")
        view = client.view(waiting.session_id, detail=True)
        finished = [
            e
            for e in client.events(waiting.session_id)
            if e["type"] == "tool_finished" and e.get("call_id") == gate.call_id
        ]
    seen = json.loads(told(llm_server, scenario)[gate.call_id])
    assert seen == {"secret": False, "network": False, "uid": seen["uid"], "session": waiting.session_id}, seen
    (call,) = view.calls or []
    assert call["meta"]["isolation"] in ("bwrap", "namespaces") and call["meta"]["decided_by"] == "alice", call
    assert call["attempts"] == 1 and len(finished) == 1, "ran once"
    assert view.response == "looked" and llm_server.count(scenario) == 2


def test_an_object_then_runs_with_its_own_timeout_and_retries(
    fleet: Any, module_settings: Settings, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    log, count = tmp_path / "runs.log", tmp_path / "flaky.count"
    write_program(tmp_path, "flaky.py", FLAKY)
    flaky = {"name": "flaky", "description": "busy twice", "command": [PY, str(tmp_path / "flaky.py"), str(count)]}
    rules = [
        {"tool": "slow", "disposition": {"tag": "defer", "then": {"tag": "runAsync", "timeoutSeconds": 1}}},
        {
            "tool": "flaky",
            "disposition": {"tag": "defer", "then": {"tag": "runAsync", "retries": 2, "backoffSeconds": 0}},
        },
    ]
    scenario = llm_server.scenario([calls(("slow", {"sleep": 30}), ("flaky", {})), text("done")])
    path = write_agent(gated(scenario, llm_server.url, [record_tool("slow", log), flaky], rules))
    with Client(module_settings, inline=False) as client:
        waiting = client.start(path, "go", run=True, timeout=60)
        gates = {p.tool: p for p in waiting.pending}
        assert {p.then for p in gates.values()} == {"runAsync"}
        for gate in gates.values():
            client.approve(gate.token or "")
        wait_for(lambda: client.view(waiting.session_id).state == State.COMPLETED, 60, "the session to complete")
    answers = told(llm_server, scenario)
    assert "did not finish within 1 s" in answers[gates["slow"].call_id], "then's timeoutSeconds, not the default"
    assert [r["tool"] for r in runs(log, phase="start")] == ["slow"] and runs(log, phase="end") == []
    assert json.loads(answers[gates["flaky"].call_id]) == {"ran": 3}, "then's retries: two failures, then done"
    assert count.read_text() == "3"


def test_a_gate_nobody_decides_expires_on_the_worker_and_never_runs(
    fleet: Any, module_settings: Settings, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    rule = {"tool": "pay", "disposition": {"tag": "defer", "then": "runAsync", "timeoutSeconds": 2}}
    scenario = llm_server.scenario([calls(("pay", {"x": 1})), text("gave up")])
    path = write_agent(gated(scenario, llm_server.url, [record_tool("pay", log)], [rule]))
    with Client(module_settings, inline=False) as client:
        waiting = client.start(path, "pay", run=True, timeout=60)
        (gate,) = waiting.pending
        wait_for(lambda: client.view(waiting.session_id).state == State.COMPLETED, 30, "the gate to expire")
        events = [e["type"] for e in client.events(waiting.session_id)]
        view = client.view(waiting.session_id, detail=True)
    error = told(llm_server, scenario)[gate.call_id]
    assert error.removeprefix("Error: ").startswith("expired:"), "the call's error result, as the model reads errors"
    assert [c["state"] for c in view.calls or []] == ["expired"]
    assert runs(log, phase="start") == [], "the tool never ran"
    assert "token_expired" in events and "call_approved" not in events
