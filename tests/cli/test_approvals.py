"""Approval gates through real `agents` processes next to the package's worker: `pending` shows a
gate's kind, `then` and digest; `approve` (with an edit, bound to the digest), `reject` and `extend`
answer the contract's documents; wrong edits, digests and targets are refused with their codes and
change nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.cli.process import agents, check_error, ok, poll
from tests.e2e.conftest import record_tool, runs
from tests.support.llm_server import LlmServer, calls, text

pytestmark = pytest.mark.usefixtures("cli_worker")

PAY = {"type": "object", "properties": {"amount": {"type": "number"}}, "required": ["amount"]}


def gated_agent(llm_server: LlmServer, folder: Path, log: Path) -> Path:
    scenario = llm_server.scenario(
        [calls(("pay", {"amount": 500}), ("pay", {"amount": 900}), ("note", {})), text("done")]
    )
    path = folder / "gated.json"
    path.write_text(
        json.dumps(
            {
                "slug": "gated",
                "model": f"openai/{scenario}",
                "apiBase": llm_server.url,
                "tools": [{**record_tool("pay", log), "parameters": PAY}, record_tool("note", log)],
                "toolCallPolicy": {
                    "default": "runSync",
                    "rules": [
                        {"tool": "pay", "disposition": {"tag": "defer", "then": "runAsync", "reason": "a payment"}},
                        {"tool": "note", "disposition": {"tag": "defer", "reason": "a person writes it"}},
                    ],
                },
            }
        )
    )
    return path


def test_a_gate_is_approved_with_an_edit_another_rejected_through_the_cli(
    qenv: dict[str, str], llm_server: LlmServer, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    agent = gated_agent(llm_server, tmp_path, log)
    view = ok(agents("session", "start", "--agent-file", agent, "-p", "pay", "--run", "--json", env=qenv))
    sid = view["session_id"]
    assert view["state"] == "waiting"
    listed = ok(agents("session", "pending", sid, "--json", env=qenv))["pending"]
    by_amount: dict[Any, dict[str, Any]] = {(p["arguments"] or {}).get("amount"): p for p in listed}
    first, second, note = by_amount[500], by_amount[900], by_amount[None]
    assert (first["kind"], first["then"], note["kind"], note["then"]) == ("approval", "runAsync", "result", None)
    assert len(first["digest"]) == 64 and first["digest"] != second["digest"]

    bad = tmp_path / "bad.json"
    bad.write_text('{"amount": "a lot"}')
    check_error(
        agents("session", "approve", first["token"], "--arguments", bad, "--json", env=qenv), "invalid_arguments"
    )
    check_error(
        agents("session", "approve", first["token"], "--digest", second["digest"], "--json", env=qenv),
        "digest_mismatch",
    )
    check_error(agents("session", "approve", note["token"], "--json", env=qenv), "not_an_approval")
    check_error(agents("session", "reject", note["token"], "--json", env=qenv), "not_an_approval")
    assert runs(log, phase="start") == [], "nothing ran, nothing changed"

    moved = ok(agents("session", "extend", second["token"], "--seconds", "7200", "--json", env=qenv))
    assert moved["expires_at"] > first["expires_at"] - 86400 + 7000

    edited = ok(
        agents(
            "session",
            "approve",
            first["token"],
            "--arguments",
            "-",
            "--digest",
            first["digest"],
            "--by",
            "alice",
            "--json",
            env=qenv,
            stdin='{"amount": 450}',
        )
    )
    assert (edited["decision"], edited["accepted"], edited["session_id"]) == ("edited", True, sid)
    check_error(agents("session", "approve", first["token"], "--json", env=qenv), "token_already_completed")
    check_error(
        agents("session", "reject", second["token"], "--digest", first["digest"], "--json", env=qenv),
        "digest_mismatch",
    )
    rejected = ok(
        agents(
            "session",
            "reject",
            second["token"],
            "--reason",
            "twice is too much",
            "--digest",
            second["digest"],
            "--json",
            env=qenv,
        )
    )
    assert rejected["decision"] == "rejected"
    responded = ok(agents("session", "complete", note["token"], "-", "--json", env=qenv, stdin="written"))
    assert responded["decision"] == "responded"

    # The session was started with --run: the worker drives it on once its last call is decided.
    done = poll(
        lambda: (v := ok(agents("session", "show", sid, "--json", env=qenv)))["state"] == "completed" and v,
        what="the session to complete",
    )
    assert done["response"] == "done"
    assert [r["args"] for r in runs(log, "pay", "start")] == [{"amount": 450}], "only the approved edit ran, once"
    assert runs(log, "note", "start") == []


def granting_agents(llm_server: LlmServer, folder: Path, log: Path) -> tuple[Path, str, str]:
    """A parent whose `pay` is a gate, with a helper sub-agent whose `pay` is the same tool behind
    the same gate: (the parent's file, the parent's scenario, the helper's)."""
    rule = {"tool": "pay", "disposition": {"tag": "defer", "then": "runAsync", "reason": "a payment"}}
    pay = {**record_tool("pay", log), "parameters": PAY}
    helper_model = llm_server.scenario([calls(("pay", {"amount": 3})), text("helper paid")])
    boss_model = llm_server.scenario(
        [
            calls(("pay", {"amount": 1})),
            calls(("pay", {"amount": 2})),
            calls(("prompt_agent_helper", {"prompt": "pay the third"})),
            text("all paid"),
        ]
    )
    common = {"apiBase": llm_server.url, "tools": [pay], "toolCallPolicy": {"default": "runSync", "rules": [rule]}}
    (folder / "helper.json").write_text(json.dumps({"slug": "helper", "model": f"openai/{helper_model}", **common}))
    boss = {"slug": "boss", "model": f"openai/{boss_model}", "subAgents": ["helper.json"], **common}
    (folder / "boss.json").write_text(json.dumps(boss))
    return folder / "boss.json", boss_model, helper_model


def test_a_grant_through_the_cli_runs_later_calls_of_the_session_but_not_of_its_children_or_forks(
    qenv: dict[str, str], llm_server: LlmServer, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    boss, _, _ = granting_agents(llm_server, tmp_path, log)
    sid = ok(agents("session", "start", "--agent-file", boss, "-p", "pay", "--run", "--json", env=qenv))["session_id"]
    (gate,) = ok(agents("session", "pending", sid, "--json", env=qenv))["pending"]
    approved = ok(agents("session", "approve", gate["token"], "--for-session", "--by", "alice", "--json", env=qenv))
    assert approved["decision"] == "approved"

    # The second payment runs without asking; the helper's payment asks its own person.
    def child_gate() -> dict[str, Any] | None:
        listed = ok(agents("session", "pending", sid, "--json", env=qenv))["pending"]
        return next((p for p in listed if p["session_id"] != sid and p["kind"] == "approval"), None)

    waiting = poll(child_gate, what="the helper's payment to wait at its gate")
    assert [r["args"]["amount"] for r in runs(log, "pay", "start")] == [1, 2], "the session's own later call ran"
    parent = ok(agents("session", "show", sid, "--json", env=qenv))
    assert (parent["grants"], parent["children"]) == (["pay"], [waiting["session_id"]])
    child = ok(agents("session", "show", waiting["session_id"], "--json", env=qenv))
    assert child["grants"] == [], "a grant covers its session, not its sub-agents"
    fork = ok(agents("session", "fork", sid, "--json", env=qenv))
    assert fork["grants"] == [] and fork["forked_from"]["session_id"] == sid, "nor the sessions forked from it"

    ok(agents("session", "approve", waiting["token"], "--json", env=qenv))
    done = poll(
        lambda: (v := ok(agents("session", "show", sid, "--json", env=qenv)))["state"] == "completed" and v,
        what="the session to complete",
    )
    assert done["response"] == "all paid"
    assert [r["args"]["amount"] for r in runs(log, "pay", "start")] == [1, 2, 3], "each payment once"
