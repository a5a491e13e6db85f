"""`agents doctor` shows the deferred calls waiting for a person: how many, how many are approval
gates, which are in the last tenth of their wait, and the nearest with their kind, `then` and
digest (never their token), in its `--json` document and its text."""

from __future__ import annotations

from pathlib import Path

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.tools.resolve import parse_agent
from tests.cli.process import agents, cli_env
from tests.e2e.conftest import record_tool, wait_for
from tests.scheduler.fakes import ScriptedLlm, llm_turn

#: the short gate's wait: its `call_expiring` is due after nine tenths of it
SHORT_WAIT_S = 3


def test_doctor_lists_the_gates_waiting_with_kind_then_and_digest_and_warns_of_those_expiring(
    settings: Settings, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    agent = parse_agent(
        {
            "slug": "payer",
            "model": "fake/model",
            "tools": [record_tool("pay", log), record_tool("wire", log), record_tool("note", log)],
            "toolCallPolicy": {
                "default": "runSync",
                "rules": [
                    {"tool": "pay", "disposition": {"tag": "defer", "then": "runSync", "timeoutSeconds": 3600}},
                    {
                        "tool": "wire",
                        "disposition": {"tag": "defer", "then": "runAsync", "timeoutSeconds": SHORT_WAIT_S},
                    },
                    {"tool": "note", "disposition": {"tag": "defer", "timeoutSeconds": 7200}},
                ],
            },
        }
    )
    asked = [("c1", "pay", '{"x": 1}'), ("c2", "wire", '{"x": 2}'), ("c3", "note", "{}")]
    with Client(settings, inline=True, llm=ScriptedLlm(llm_turn(*asked))) as client:
        sid = client.start(agent, "pay and wire", run=True).session_id
        listed = {p.tool: p for p in client.pending(sid)}
        # Redis's clock past the moment the short gate's `call_expiring` is due (no worker runs here
        # to expire it afterwards: it stays waiting, overdue).
        due = listed["wire"].expires_at - SHORT_WAIT_S / 10  # type: ignore[operator]
        wait_for(lambda: client.store.server_time() > due, timeout=SHORT_WAIT_S + 5, what="the warning to be due")
    env = cli_env(redis_url, prefix)
    report = agents("doctor", "--json", env=env).doc
    waiting = report["deferred_calls"]
    assert (waiting["waiting"], waiting["gates"], waiting["expiring"]) == (3, 2, 1), waiting
    nearest = {p["tool"]: p for p in waiting["nearest"]}
    assert [p["tool"] for p in waiting["nearest"]] == ["wire", "pay", "note"], "nearest deadline first"
    for tool, kind, then in (
        ("wire", "approval", "runAsync"),
        ("pay", "approval", "runSync"),
        ("note", "result", None),
    ):
        shown = nearest[tool]
        assert (shown["kind"], shown["then"], shown["digest"]) == (kind, then, listed[tool].digest), shown
        assert shown["session_id"] == sid and shown["expiring"] is (tool == "wire")
        assert "token" not in shown and "arguments" not in shown, "a shareable report holds no token"
    assert nearest["pay"]["seconds_left"] > 3000 and nearest["wire"]["seconds_left"] < SHORT_WAIT_S
    [check] = [c for c in report["checks"] if c["name"] == "deferred calls"]
    assert check["severity"] == "warning" and "fails_doctor" not in check, "a warning to act on, not a failure"
    assert "wire of " + sid in check["detail"]

    text = agents("doctor", env=env)  # fails: no worker serves this Redis
    assert f"wire of {sid}: approval then runAsync" in text.stdout and "expiring" in text.stdout
    assert f"note of {sid}: result," in text.stdout
    assert f"digest {listed['pay'].digest[:16]}" in text.stdout
    assert listed["pay"].token not in text.stdout + str(report), "no token in doctor's report"
