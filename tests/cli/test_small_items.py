"""The smaller things a person meets on the command line: --version, `running` as a status,
`logs --follow` ending with its session, help texts, warnings only where they apply, errors that
name what they tried, hints for `complete`, broken JSON results refused, failed tool calls
summarised, and doctor failing while messages wait on a queue nobody consumes."""

from __future__ import annotations

import inspect
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_agents import __version__
from tests.cli.probe import write_probe_agent
from tests.cli.process import agents, check_error, cli_env, ok
from tests.support.llm_server import LlmServer, Reply, calls, text
from tests.support.redis_server import free_port

pytestmark = pytest.mark.usefixtures("cli_worker")


def answer(request: dict[str, Any]) -> Reply:
    return text("fine")


def failing_tool_then_answer(request: dict[str, Any]) -> Reply:
    if request["messages"][-1]["role"] == "tool":
        return text("I could not check, sorry")
    return calls(("broken", {}))


def plain_agent(folder: Path, llm_server: LlmServer, reply: Any = answer, **extra: Any) -> Path:
    agent = folder / f"plain-{uuid.uuid4().hex[:6]}.json"
    data = {"slug": "plain", "model": f"openai/{llm_server.scenario([reply])}", "apiBase": llm_server.url, **extra}
    agent.write_text(json.dumps(data))
    return agent


def test_version(qenv: dict[str, str]) -> None:
    run = agents("--version", env=qenv)
    assert run.returncode == 0 and run.stdout == f"agents (celery-agents) {__version__}\n", str(run)


def test_running_is_a_status_list_takes(qenv: dict[str, str]) -> None:
    assert "sessions" in ok(agents("session", "list", "--status", "running", "--json", env=qenv))


def test_logs_follow_ends_when_the_session_ends(llm_server: LlmServer, qenv: dict[str, str], tmp_path: Path) -> None:
    sid = ok(agents("run", "--agent-file", plain_agent(tmp_path, llm_server), "-p", "x", "--json", env=qenv))[
        "session_id"
    ]
    run = agents("session", "logs", sid, "--follow", env=qenv, timeout=60)
    assert run.returncode == 0 and "session completed" in run.stdout, str(run)
    # Following a session that ended prints what `logs` prints: the end's write, to its last event.
    assert run.stdout == agents("session", "logs", sid, env=qenv).stdout
    followed = agents("session", "logs", sid, "--follow", "--json", env=qenv, timeout=60)
    assert followed.stdout == agents("session", "logs", sid, "--json", env=qenv).stdout
    assert json.loads(followed.stdout.splitlines()[-1])["type"] == "step_committed"


def test_help_texts(qenv: dict[str, str]) -> None:
    session = agents("session", "--help", env=qenv).stdout
    for command in ("run-isolated", "delete", "purge", "prefix"):
        assert command in session, session
    logs = agents("session", "logs", "--help", env=qenv).stdout
    assert "one per line" in " ".join(logs.split()), logs
    for args in (["run", "--help"], ["session", "show", "--help"], ["session", "--help"], ["--help"]):
        shown = agents(*args, env=qenv).stdout
        assert "<bool>" not in shown, shown


def test_help_paragraphs_are_wrapped_by_the_terminal_not_broken_in_the_source() -> None:
    """typer's rich help keeps a docstring's line breaks: a paragraph written over two source lines
    shows up broken mid-sentence (`agents session --help` at 80 columns), so each is one line."""
    import click
    import typer

    from celery_agents.cli.main import app

    broken: list[str] = []

    def visit(command: Any, path: str, ctx: click.Context) -> None:
        for paragraph in inspect.cleandoc(command.help or "").split("\n\n"):
            if "\n" in paragraph:
                broken.append(f"{path}: {paragraph!r}")
        for param in command.get_params(ctx):
            if "\n" in (getattr(param, "help", None) or ""):
                broken.append(f"{path} {param.name}: {param.help!r}")
        for name in command.list_commands(ctx) if hasattr(command, "list_commands") else []:
            sub = command.get_command(ctx, name)
            visit(sub, f"{path} {name}", click.Context(sub, info_name=name, parent=ctx))

    root = typer.main.get_command(app)
    visit(root, "agents", click.Context(root, info_name="agents"))
    assert not broken, "\n".join(broken)


def test_the_isolated_queue_warning_only_for_agents_that_run_isolated_calls(
    llm_server: LlmServer, qenv: dict[str, str], tmp_path: Path
) -> None:
    # The package's worker consumes steps and tools, not isolated.
    plain = agents("run", "--agent-file", plain_agent(tmp_path, llm_server), "-p", "x", env=qenv)
    assert plain.returncode == 0 and "isolated" not in plain.stderr, str(plain)
    isolating, _ = write_probe_agent(tmp_path / "iso", llm_server.scenario([answer]), llm_server.url)
    run = agents("session", "start", "--agent-file", isolating, "-p", "x", "--run", env=qenv)
    assert run.returncode == 0 and "no worker consumes the isolated queue" in run.stderr, str(run)


def test_errors_name_the_redis_and_the_model_endpoint_they_tried(
    qenv: dict[str, str], tmp_path: Path, redis_url: str
) -> None:
    port = free_port()
    down = cli_env(f"redis://:hunter2@127.0.0.1:{port}/0", "somewhere")
    err = check_error(agents("session", "list", "--json", env=down), "redis_unavailable")
    assert f"127.0.0.1:{port}" in err["message"] and "prefix somewhere" in err["message"], err
    assert "hunter2" not in err["message"]
    endpoint = f"http://127.0.0.1:{free_port()}/v1"
    agent = tmp_path / "down.json"
    agent.write_text(json.dumps({"slug": "down", "model": "openai/nothing", "apiBase": endpoint, "apiKeyEnv": "K"}))
    env = {**qenv, "AGENTS_LLM_ATTEMPTS": "1", "K": "x"}
    run = agents("run", "--agent-file", agent, "-p", "x", "--inline", "--json", env=env)
    assert run.returncode == 5, str(run)
    assert endpoint in run.doc["error"]["message"], run.doc


def test_complete_hints_at_a_session_id_or_inline_json(
    llm_server: LlmServer, qenv: dict[str, str], tmp_path: Path
) -> None:
    agent, _ = write_probe_agent(
        tmp_path, llm_server.scenario([calls(("approve", {"x": "1"})), text("ok")]), llm_server.url
    )
    view = ok(agents("session", "start", "--agent-file", agent, "-p", "x", "--run", "--json", env=qenv))
    sid, token = view["session_id"], view["pending"][0]["token"]
    err = check_error(agents("session", "complete", sid, "-", "--json", stdin="{}", env=qenv), "unknown_token")
    assert f"agents session pending {sid}" in err["message"], err
    err = check_error(agents("session", "complete", token, '{"ok": true}', "--json", env=qenv), "invalid_result")
    assert "pipe" in err["message"] and "agents session complete TOKEN -" in err["message"], err
    broken = tmp_path / "broken.json"
    broken.write_text('{"booked": true,')
    err = check_error(agents("session", "complete", token, broken, "--json", env=qenv), "invalid_result")
    assert "not valid JSON" in err["message"] and "--text" in err["message"], err
    ok(agents("session", "complete", token, broken, "--text", "--json", env=qenv))
    done = ok(agents("session", "show", sid, "--json", env=qenv))
    [call] = [c for c in done["calls"] if c["tool"] == "approve"]
    assert call["result"] == '{"booked": true,', call


def test_a_run_whose_tools_failed_says_so(llm_server: LlmServer, qenv: dict[str, str], tmp_path: Path) -> None:
    failing = [sys.executable, "-c", "import sys; sys.stderr.write('the weather service is down'); sys.exit(3)"]
    agent = plain_agent(tmp_path, llm_server, failing_tool_then_answer, tools=[{"name": "broken", "command": failing}])
    run = agents("run", "--agent-file", agent, "-p", "x", env=qenv)
    assert run.returncode == 0 and run.stdout == "I could not check, sorry\n", str(run)
    assert "1 tool call(s) failed" in run.stderr and "broken: the weather service is down" in run.stderr, str(run)
    sid = ok(agents("session", "list", "--json", env=qenv))["sessions"][0]["session_id"]
    shown = agents("session", "show", sid, env=qenv).stdout  # no colours in a pipe: said in words
    assert "error broken [" in shown and "result broken [" not in shown, shown


def test_doctor_fails_while_messages_wait_on_a_queue_no_worker_consumes(
    llm_server: LlmServer, redis_url: str, tmp_path: Path
) -> None:
    prefix = f"doc{uuid.uuid4().hex[:8]}"
    env = cli_env(redis_url, prefix)
    client = redis.Redis.from_url(redis_url, decode_responses=True)

    def beat(queues: list[str]) -> None:
        client.hset(
            f"{prefix}:workers", "w@test", json.dumps({"pid": 1, "host": "test", "at": time.time(), "queues": queues})
        )

    beat(["tools", "isolated"])  # alive, but nobody takes steps
    ok(
        agents(
            "session",
            "start",
            "--agent-file",
            plain_agent(tmp_path, llm_server),
            "-p",
            "x",
            "--run",
            "--no-wait",
            "--json",
            env=env,
        )
    )
    run = agents("doctor", "--json", env=env)
    assert run.returncode == 1, str(run)
    [check] = [c for c in run.doc["checks"] if c["name"] == "queues"]
    assert not check["ok"] and "steps" in check["detail"], check
    beat(["steps", "tools", "isolated"])
    [check] = [c for c in ok(agents("doctor", "--json", env=env))["checks"] if c["name"] == "queues"]
    assert check["ok"], check
    client.close()


def test_wrong_input_is_said_as_it_was_typed(qenv: dict[str, str], llm_server: LlmServer, tmp_path: Path) -> None:
    """An empty id is no id (exit 2), not an unknown session; a bad --grant names the pair as
    written, not pydantic's report with its web address; options that take text or files say so,
    not their Python type."""
    check_error(agents("session", "show", "", "--json", env=qenv), "invalid_input")
    agent = plain_agent(tmp_path, llm_server)
    sid = ok(agents("session", "start", "--agent-file", agent, "-p", "x", "--json", env=qenv))
    bad = check_error(
        agents("session", "resume", sid["session_id"], "--grant", "modelCalls=abc", "--json", env=qenv), "invalid_input"
    )
    assert "modelCalls='abc'" in bad["message"] and "pydantic" not in bad["message"], bad
    shown = agents("run", "--help", env=qenv).stdout
    assert "list[str]" not in shown and "TEXT" in shown and "FILE" in shown, shown
