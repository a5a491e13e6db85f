"""What a session records of its tool calls (through the real runtime and Redis): the result as
JSON or text, media beside it, and duration, exit status and attempts in `session show`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.model import State
from tests.support.llm_server import LlmServer, calls, text
from tests.tools.conftest import PY, write_program
from tests.tools.sample_tools import PNG_1PX


def run_session(
    settings: Settings,
    llm_server: LlmServer,
    write_agent: Any,
    tools: list[dict[str, Any]],
    rules: list[dict[str, Any]],
    tool_calls: list[tuple[str, dict[str, Any]]],
) -> tuple[Any, str]:
    scenario = llm_server.scenario([calls(*tool_calls), text("noted")])
    path = write_agent(
        {
            "slug": "results",
            "model": f"openai/{scenario}",
            "apiBase": llm_server.url,
            "tools": tools,
            "toolCallPolicy": {"default": "runSync", "rules": rules},
        }
    )
    with Client(settings, inline=True) as client:
        view = client.start(path, "go", run=True)
        assert view.state == State.COMPLETED, view.error
        return client.show(view.session_id), scenario


def test_an_isolated_image_reaches_the_model_as_media(
    settings: Settings, llm_server: LlmServer, write_agent: Any
) -> None:
    shown, scenario = run_session(
        settings,
        llm_server,
        write_agent,
        [{"name": "pic", "python": "tests.tools.sample_tools:picture"}],
        [{"tool": "pic", "disposition": "runIsolated"}],
        [("pic", {"caption": "dot"})],
    )
    (call,) = shown.calls
    assert call["state"] == "completed" and call["result"].startswith("attached: image/png")
    assert call["meta"]["media"] == [{"mime_type": "image/png", "data_base64": PNG_1PX, "filename": "dot.png"}]
    last = llm_server.requests[scenario][-1]["messages"]
    images = [
        part
        for m in last
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if part.get("type") == "image_url"
    ]
    assert len(images) == 1 and PNG_1PX in images[0]["image_url"]["url"]


def test_duration_exit_status_and_attempts_are_recorded(
    settings: Settings, llm_server: LlmServer, write_agent: Any, tooldir: Path
) -> None:
    write_program(
        tooldir,
        "once_busy.py",
        """
        import json, os, sys
        flag = sys.argv[1]
        if not os.path.exists(flag):
            open(flag, "w").close()
            sys.stderr.write("busy, try again")
            sys.exit(75)
        print(json.dumps({"ok": True}))
    """,
    )
    tools = [
        {"name": "busy", "command": [PY, str(tooldir / "once_busy.py"), str(tooldir / "flag")]},
        {"name": "fails", "command": [PY, "-c", "import sys; sys.stderr.write('bad city'); sys.exit(4)"]},
    ]
    rules = [
        {"tool": "busy", "disposition": {"tag": "runAsync", "retries": 2, "backoffSeconds": 0.01}},
        {"tool": "fails", "disposition": "runIsolated"},
    ]
    shown, _ = run_session(settings, llm_server, write_agent, tools, rules, [("busy", {}), ("fails", {})])
    busy, fails = shown.calls
    assert (busy["state"], busy["result"], busy["attempts"], busy["exit_status"]) == ("completed", {"ok": True}, 2, 0)
    assert busy["meta"]["earlier_attempts"] == ["busy, try again"] and busy["duration_ms"] > 0
    assert (fails["state"], fails["error"], fails["attempts"], fails["exit_status"]) == ("failed", "bad city", 1, 4)
    assert fails["meta"]["isolation"] in ("namespaces", "bwrap") and fails["duration_ms"] > 0


def test_a_runsync_image_reaches_the_model_as_media(
    settings: Settings, llm_server: LlmServer, write_agent: Any
) -> None:
    shown, _ = run_session(
        settings,
        llm_server,
        write_agent,
        [{"name": "pic", "python": "tests.tools.sample_tools:picture"}],
        [],
        [("pic", {})],
    )
    (call,) = shown.calls
    assert call["meta"]["media"][0]["mime_type"] == "image/png"


def test_tool_output_too_deep_or_with_too_long_a_number_is_kept_as_text() -> None:
    from celery_agents.tools.output import parse_output

    deep = "[" * 100_000 + "]" * 100_000
    assert parse_output(deep) == deep
    huge = "9" * 10_000
    assert parse_output(huge) == huge
