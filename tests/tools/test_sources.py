"""Each kind of tool has one source, chosen by the tool's kind, and a source gets one `ToolRun`
holding what the verified spec decided for the call."""

from __future__ import annotations

from typing import get_args

import pytest

from celery_agents.model import CallOutcome
from celery_agents.model.agent import ToolKind
from celery_agents.tools import ToolRunner
from celery_agents.tools.call import Host, ToolRun
from celery_agents.tools.sources import SOURCES
from tests.tools.conftest import make_agent, run_tool


def test_every_kind_but_external_has_a_source() -> None:
    assert set(SOURCES) == set(get_args(ToolKind)) - {"external"}


class Recording:
    def __init__(self) -> None:
        self.runs: list[tuple[ToolRun, Host]] = []

    def run(self, run: ToolRun, host: Host) -> CallOutcome:
        self.runs.append((run, host))
        return CallOutcome(state="completed", result="x" * 50)


def test_the_source_of_the_tools_kind_gets_what_the_policy_decided(monkeypatch: pytest.MonkeyPatch) -> None:
    recording = Recording()
    monkeypatch.setitem(SOURCES, "command", recording)
    rule = {"timeoutSeconds": 7, "truncate": 10, "limits": {"memoryMb": 64}, "network": True}
    agent = make_agent(
        [{"name": "fetch", "command": ["true"], "limits": {"cpuSeconds": 3}}],
        rules=[{"tool": "fetch", "disposition": {"tag": "runIsolated", **rule}}],
    )
    runner = ToolRunner(isolated=True)
    outcome = run_tool(runner, agent, "fetch", {"url": "u"}, session_id="s-1", call_id="call_9")
    [(run, host)] = recording.runs
    assert host is runner and host.isolated
    assert (run.tool.name, run.arguments, run.timeout, run.network) == ("fetch", {"url": "u"}, 7, True)
    assert (run.limits.memory_mb, run.limits.cpu_seconds) == (64, 3)
    assert (run.session_id, run.call_id, run.idempotency_key) == ("s-1", "call_9", "s-1:0:call_9")
    assert run.variables()["AGENTS_IDEMPOTENCY_KEY"] == "s-1:0:call_9"
    assert outcome.meta.truncated == {"bytes": 50, "limit": 10}, "the disposition's decorators wrap the source"


def test_an_external_tool_reaches_no_source(monkeypatch: pytest.MonkeyPatch) -> None:
    recording = Recording()
    for kind in list(SOURCES):
        monkeypatch.setitem(SOURCES, kind, recording)
    outcome = run_tool(ToolRunner(), make_agent([{"name": "ask", "external": True}]), "ask")
    assert outcome.state == "failed" and "external tool" in (outcome.error or "")
    assert recording.runs == []
