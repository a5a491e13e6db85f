"""History, fork and rerun through real `agents` processes next to the package's worker: the
history lists every version with what it did; a rerun on the worker reuses the origin's recorded
result of a side-effect tool (it ran once across origin and rerun), `--fresh` runs it again, and
`--dry-run` says which would run and changes nothing; `fork --agent-file` binds another agent,
whose model then drives the fork on the worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.process import agents, ok
from tests.e2e.conftest import record_tool, runs
from tests.support.llm_server import LlmServer, calls, text

pytestmark = pytest.mark.usefixtures("cli_worker")


def paying_agent(llm_server: LlmServer, folder: Path, log: Path) -> Path:
    scenario = llm_server.scenario([calls(("pay", {"x": 7})), text("paid")])
    path = folder / "payer.json"
    path.write_text(
        json.dumps(
            {
                "slug": "payer",
                "model": f"openai/{scenario}",
                "apiBase": llm_server.url,
                "tools": [record_tool("pay", log)],
                "toolCallPolicy": {"default": "runAsync"},
            }
        )
    )
    return path


def test_history_fork_and_rerun_on_a_worker(qenv: dict[str, str], llm_server: LlmServer, tmp_path: Path) -> None:
    log = tmp_path / "runs.log"
    agent = paying_agent(llm_server, tmp_path, log)
    origin = ok(agents("session", "start", "--agent-file", agent, "-p", "pay", "--run", "--json", env=qenv))
    sid = origin["session_id"]
    assert (origin["state"], origin["response"]) == ("completed", "paid")
    assert len(runs(log, "pay", "start")) == 1

    versions = ok(agents("session", "history", sid, "--json", env=qenv))["versions"]
    assert [v["version"] for v in versions] == list(range(1, origin["version"] + 1))
    assert [v["kind"] for v in versions] == ["started", "llm", "tools", "llm"]
    assert all(v["summary"] and v["at"] > 0 for v in versions)
    assert [v["summary"] for v in versions[1:]] == [
        'llm: model asked for pay({"x": 7})',
        "tools: dispatched pay",
        "llm: 1 tool result to the model, model answered: paid",
    ]
    assert set(versions[0]) == {"version", "turns", "head", "state", "kind", "at", "summary"}

    listed = ok(agents("session", "list", "--json", "--limit", "500", env=qenv))["sessions"]
    plan = ok(agents("session", "rerun", sid, "--from", "2", "--dry-run", "--json", env=qenv))
    assert plan == {"would_run": [], "reused": [{"tool": "pay", "arguments": {"x": 7}, "disposition": "runAsync"}]}
    fresh_plan = ok(agents("session", "rerun", sid, "--from", "2", "--dry-run", "--fresh", "--json", env=qenv))
    assert fresh_plan == {"would_run": plan["reused"], "reused": []}
    assert ok(agents("session", "list", "--json", "--limit", "500", env=qenv))["sessions"] == listed, "nothing made"

    rerun = ok(agents("session", "rerun", sid, "--from", "1", "--json", env=qenv))
    assert (rerun["state"], rerun["response"]) == ("completed", "paid")
    assert rerun["forked_from"] == {"session_id": sid, "version": 1}
    assert len(runs(log, "pay", "start")) == 1, "the recorded result was reused: pay ran once in all"

    fresh = ok(agents("session", "rerun", sid, "--from", "2", "--fresh", "--json", env=qenv))
    assert fresh["state"] == "completed" and fresh["forked_from"] == {"session_id": sid, "version": 2}
    assert len(runs(log, "pay", "start")) == 2, "--fresh ran it again"

    fork = ok(agents("session", "fork", sid, "--at", "2", "--json", env=qenv))
    assert (fork["state"], fork["head"], fork["forked_from"]) == ("tools", "LlmTurn", {"session_id": sid, "version": 2})
    shown = ok(agents("session", "show", fork["session_id"], "--json", env=qenv))
    assert [t["kind"] for t in shown["turns"]] == ["UserTurn", "LlmTurn"]
    again = ok(agents("session", "show", sid, "--json", env=qenv))
    assert again["version"] == origin["version"] and len(again["turns"]) == 4, "the origin did not change"


def test_fork_with_another_agent_file_runs_on_the_worker_as_that_agent(
    qenv: dict[str, str], llm_server: LlmServer, tmp_path: Path
) -> None:
    """`fork --agent-file`: the fork is bound to the other agent, and its model answers on the
    worker. Forked where the origin's `pay` was still running (version 3, PartialUserTurn), the fork
    takes the result the origin recorded for it since: the call ran, it does not run again."""
    log = tmp_path / "runs.log"
    origin = ok(
        agents(
            "session",
            "start",
            "--agent-file",
            paying_agent(llm_server, tmp_path, log),
            "-p",
            "pay",
            "--run",
            "--json",
            env=qenv,
        )
    )
    sid = origin["session_id"]
    other_model = llm_server.scenario([text("paid by the other agent")])
    other = tmp_path / "other.json"
    other.write_text(
        json.dumps(
            {
                "slug": "other-payer",
                "model": f"openai/{other_model}",
                "apiBase": llm_server.url,
                "tools": [record_tool("pay", log)],
                "toolCallPolicy": {"default": "runAsync"},
            }
        )
    )
    fork = ok(agents("session", "fork", sid, "--at", "3", "--agent-file", other, "--json", env=qenv))
    assert (fork["agent"], fork["head"], fork["forked_from"]) == (
        "other-payer",
        "PartialUserTurn",
        {"session_id": sid, "version": 3},
    )
    done = ok(agents("session", "resume", fork["session_id"], "--json", env=qenv))
    assert (done["state"], done["response"], done["agent"]) == ("completed", "paid by the other agent", "other-payer")
    assert len(runs(log, "pay", "start")) == 1, "the copied call had run: it did not run again"
    shown = ok(agents("session", "show", fork["session_id"], "--json", env=qenv))
    assert [c["state"] for c in shown["calls"]] == ["completed"]
    again = ok(agents("session", "show", sid, "--json", env=qenv))
    assert (again["agent"], again["version"]) == ("payer", origin["version"])
