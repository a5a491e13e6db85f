"""`agents session send` through a real `agents` process next to the package's worker: a follow-up
that the workers answer (`--run --json`), a queued message (the JSON view), the refusals (a
cancelled session, exit 5; a prompt over AGENTS_MAX_PROMPT_BYTES, exit 2; an unknown session)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.cli.process import agents, check_error, ok
from tests.support.llm_server import LlmServer, text

pytestmark = pytest.mark.usefixtures("cli_worker")


def echo_agent(llm_server: LlmServer, folder: Path) -> Path:
    def answer(body: dict[str, Any]) -> Any:
        asked = [m["content"] for m in body["messages"] if m["role"] == "user"]
        return text(" / ".join(asked))

    path = folder / "echo.json"
    path.write_text(
        json.dumps({"slug": "echo", "model": f"openai/{llm_server.scenario([answer])}", "apiBase": llm_server.url})
    )
    return path


def test_send_run_continues_the_conversation(qenv: dict[str, str], llm_server: LlmServer, tmp_path: Path) -> None:
    agent = echo_agent(llm_server, tmp_path)
    first = ok(agents("session", "start", "--agent-file", agent, "-p", "one", "--run", "--json", env=qenv))
    assert first["response"] == "one"
    again = ok(agents("session", "send", first["session_id"][:12], "-p", "two", "--run", "--json", env=qenv))
    assert (again["session_id"], again["state"], again["response"]) == (first["session_id"], "completed", "one / two")
    assert (again["parent"], again["children"]) == (None, [])


def test_send_without_run_leaves_the_session_ready(qenv: dict[str, str], llm_server: LlmServer, tmp_path: Path) -> None:
    agent = echo_agent(llm_server, tmp_path)
    view = ok(agents("session", "start", "--agent-file", agent, "-p", "one", "--json", env=qenv))
    queued = ok(agents("session", "send", view["session_id"], "-p", "two", "--json", env=qenv))
    assert (queued["state"], queued["steps"]) == ("ready", 0)
    done = ok(agents("session", "resume", view["session_id"], "--json", env=qenv))
    assert done["response"] == "one / two", "both messages reach the first model call, in order"


def test_send_is_refused_by_a_cancelled_session(qenv: dict[str, str], llm_server: LlmServer, tmp_path: Path) -> None:
    agent = echo_agent(llm_server, tmp_path)
    sid = ok(agents("session", "start", "--agent-file", agent, "-p", "one", "--json", env=qenv))["session_id"]
    ok(agents("session", "cancel", sid, "--json", env=qenv))
    check_error(agents("session", "send", sid, "-p", "hello?", "--json", env=qenv), "session_not_advanceable")


def test_send_refuses_a_prompt_over_the_limit_and_an_unknown_session(
    qenv: dict[str, str], llm_server: LlmServer, tmp_path: Path
) -> None:
    agent = echo_agent(llm_server, tmp_path)
    sid = ok(agents("session", "start", "--agent-file", agent, "-p", "one", "--json", env=qenv))["session_id"]
    small = {**qenv, "AGENTS_MAX_PROMPT_BYTES": "10"}
    error = check_error(agents("session", "send", sid, "-p", "x" * 11, "--json", env=small), "invalid_input")
    assert "AGENTS_MAX_PROMPT_BYTES" in error["message"]
    check_error(agents("session", "send", "f" * 32, "-p", "hi", "--json", env=qenv), "unknown_session")
