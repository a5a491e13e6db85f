"""Every command's `--json` document, as the contract fixes it, from real `agents` processes in
queue mode next to a real worker: exactly one JSON document on stdout and nothing else."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.cli.probe import write_probe_agent
from tests.cli.process import (
    Run,
    agents,
    check_completion,
    check_pending_call,
    check_view,
    ok,
)
from tests.support.llm_server import LlmServer, calls, text

pytestmark = pytest.mark.usefixtures("cli_worker")


@pytest.fixture(scope="module")
def flow(llm_server: LlmServer, qenv: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One session taken through every command; each command's finished process by name."""
    folder = tmp_path_factory.mktemp("documents")
    scenario = llm_server.scenario([calls(("probe_sync", {"x": "a"}), ("approve", {"x": "b"})), text("all done")])
    agent, _ = write_probe_agent(folder, scenario, llm_server.url)
    r: dict[str, Any] = {"scenario": scenario}
    r["start"] = agents("session", "start", "--agent-file", agent, "-p", "hello", "--json", env=qenv)
    sid = ok(r["start"])["session_id"]
    r["requests_after_start"] = llm_server.count(scenario)
    r["step_llm"] = agents("session", "step", sid, "--json", env=qenv)
    r["step_tools"] = agents("session", "step", sid, "--json", env=qenv)
    r["pending_one"] = agents("session", "pending", sid, "--json", env=qenv)
    r["pending_all"] = agents("session", "pending", "--json", env=qenv)
    r["show"] = agents("session", "show", sid, "--json", env=qenv)
    r["list"] = agents("session", "list", "--json", env=qenv)
    r["pause"] = agents("session", "pause", sid, "--json", env=qenv)
    token = ok(r["pending_one"])["pending"][0]["token"]
    result = folder / "result.json"
    result.write_text('{"approved": true}')
    r["complete"] = agents("session", "complete", token, result, "--json", env=qenv)
    r["resume"] = agents("session", "resume", sid, "--json", env=qenv)
    r["resume_again"] = agents("session", "resume", sid, "--json", env=qenv)
    r["run_isolated"] = agents("session", "run-isolated", sid, "--json", env=qenv)
    r["logs"] = agents("session", "logs", sid, "--json", env=qenv)
    r["show_human"] = agents("session", "show", sid, env=qenv)
    other = ok(agents("session", "start", "--agent-file", agent, "-p", "to cancel", "--json", env=qenv))
    r["cancel"] = agents("session", "cancel", other["session_id"], "--json", env=qenv)
    r["resume_cancelled"] = agents("session", "resume", other["session_id"], "--json", env=qenv)
    answer = llm_server.scenario([text("straight answer")])
    plain, _ = write_probe_agent(folder, answer, llm_server.url, name="plain.json")
    r["run"] = agents("run", "--agent-file", plain, "-p", "just answer", "--json", env=qenv)
    r["doctor"] = agents("doctor", "--json", env=qenv)
    r["sid"] = sid
    r["token"] = token
    return r


def test_start_stores_the_prompt_and_calls_no_model(flow: dict[str, Any]) -> None:
    v = check_view(ok(flow["start"]))
    assert (v["state"], v["head"], v["version"], v["steps"], v["pending"]) == ("ready", "UserTurn", 1, 0, [])
    assert v["response"] is None and v["error"] is None
    assert flow["requests_after_start"] == 0


def test_step_documents_follow_the_session(flow: dict[str, Any]) -> None:
    llm = check_view(ok(flow["step_llm"]))
    assert (llm["state"], llm["head"], llm["version"], llm["steps"]) == ("tools", "LlmTurn", 2, 1)
    tools = check_view(ok(flow["step_tools"]))
    assert (tools["state"], tools["head"], tools["steps"]) == ("waiting", "PartialUserTurn", 2)
    assert [p["tool"] for p in tools["pending"]] == ["approve"]
    (p,) = tools["pending"]
    assert p["disposition"] == "defer" and p["state"] == "deferred" and p["reason"] == "a person approves"
    assert p["arguments"] == {"x": "b"} and p["expires_at"] > p["created_at"]


def test_pending_prints_an_object_holding_the_list(flow: dict[str, Any]) -> None:
    one = ok(flow["pending_one"])
    assert set(one) == {"pending"}
    assert len(one["pending"]) == 1
    for p in one["pending"]:
        check_pending_call(p)
    everywhere = ok(flow["pending_all"])
    assert set(everywhere) == {"pending"}
    for p in everywhere["pending"]:
        check_pending_call(p)
    assert one["pending"][0] in everywhere["pending"]


def test_show_list_pause_are_views(flow: dict[str, Any]) -> None:
    shown = check_view(ok(flow["show"]))
    assert shown["session_id"] == flow["sid"] and shown["state"] == "waiting"
    listed = ok(flow["list"])
    assert set(listed) == {"sessions"}
    for v in listed["sessions"]:
        check_view(v)
    assert flow["sid"] in [v["session_id"] for v in listed["sessions"]]
    paused = check_view(ok(flow["pause"]))
    assert paused["session_id"] == flow["sid"]


def test_complete_prints_the_contracts_object(flow: dict[str, Any]) -> None:
    done = check_completion(ok(flow["complete"]))
    assert done["token"] == flow["token"] and done["session_id"] == flow["sid"]
    assert done["call_id"] == "call_0_1" and done["remaining"] == 0
    assert done["woken"] is False  # manual drive: nobody steps it until asked


def test_resume_runs_the_session_to_its_answer(flow: dict[str, Any]) -> None:
    v = check_view(ok(flow["resume"]))
    assert (v["state"], v["head"], v["response"], v["pending"]) == ("completed", "LlmTurn", "all done", [])
    assert check_view(ok(flow["run_isolated"]))["state"] == "completed"
    assert "no runIsolated call of this session waits to run: nothing ran" in flow["run_isolated"].stderr


def test_resuming_a_completed_session_is_its_view_a_cancelled_one_a_conflict(flow: dict[str, Any]) -> None:
    """A program that completes a call and resumes finds the session done when a worker finished
    it first: nothing is left to drive, and that is a success (exit 0, the view). A cancelled
    session cannot go on: exit 5."""
    again = check_view(ok(flow["resume_again"]))
    assert (again["state"], again["response"]) == ("completed", "all done")
    refused = flow["resume_cancelled"]
    assert refused.returncode == 5, refused.stdout + refused.stderr
    assert refused.doc["error"]["code"] == "session_not_advanceable"


def test_cancel_and_run_are_views(flow: dict[str, Any]) -> None:
    cancelled = check_view(ok(flow["cancel"]))
    assert cancelled["state"] == "cancelled"
    ran = check_view(ok(flow["run"]))
    assert (ran["state"], ran["response"]) == ("completed", "straight answer")


def test_logs_print_one_json_event_per_line(flow: dict[str, Any]) -> None:
    run: Run = flow["logs"]
    assert run.returncode == 0, str(run)
    events = run.lines
    assert events and all({"id", "type", "at", "version"} <= e.keys() for e in events)
    types = [e["type"] for e in events]
    assert types[0] == "session_started"
    assert {"llm_called", "token_created", "token_completed", "completed"} <= set(types), types


def test_doctor_reports_checks(flow: dict[str, Any]) -> None:
    report = ok(flow["doctor"])
    assert report["ok"] is True and report["mode"] == "queue"
    assert all(isinstance(c["name"], str) and isinstance(c["ok"], bool) for c in report["checks"])
    assert report["workers"]


def test_without_json_the_session_view_goes_to_stdout(flow: dict[str, Any]) -> None:
    run: Run = flow["show_human"]
    assert run.returncode == 0, str(run)
    assert run.stderr == ""
    assert flow["sid"] in run.stdout and "all done" in run.stdout


def test_usage_errors_exit_2_with_an_error_document(qenv: dict[str, str], tmp_path: Path) -> None:
    agent = tmp_path / "a.json"
    agent.write_text(json.dumps({"slug": "x", "model": "demo/x"}))
    cases = [
        ("session", "step", "--json"),
        ("session", "show", "--bogus", "--json"),
        ("run", "--agent-file", str(agent), "-p", "x", "--thinking", "loud", "--json"),
        ("session", "start", "--agent-file", str(agent), "-p", "x", "--step", "--run", "--json"),
        ("session", "start", "--agent-file", str(agent), "--json"),
        ("nonsense", "--json"),
        ("session", "list", "--status", "sleeping", "--json"),
    ]
    for args in cases:
        run = agents(*args, env=qenv)
        assert run.returncode == 2, str(run)
        assert run.doc["error"]["code"] == "invalid_input", str(run)
    for args in cases[:3]:
        human = agents(*args[:-1], env=qenv)
        assert human.returncode == 2 and human.stdout == "" and "Traceback" not in human.stderr, str(human)


def test_send_with_step_and_run_exits_2_and_sends_nothing(flow: dict[str, Any], qenv: dict[str, str]) -> None:
    sid = flow["sid"]
    before = ok(agents("session", "show", sid, "--json", env=qenv))
    run = agents("session", "send", sid, "-p", "more", "--step", "--run", "--json", env=qenv)
    assert run.returncode == 2, str(run)
    assert run.doc["error"]["code"] == "invalid_input" and "--step or --run" in run.doc["error"]["message"]
    after = ok(agents("session", "show", sid, "--json", env=qenv))
    assert (after["state"], after["version"]) == (before["state"], before["version"]), "no message was sent"
