"""Commands that call no model never import litellm (seconds and hundreds of MB at import), nor
FastAPI (only `agents serve` needs it):
checked with `python -X importtime`, which lists every module a process imported on stderr."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.probe import write_probe_agent
from tests.cli.process import DEMO_AGENT, Run, agents, cli_env, ok
from tests.support.llm_server import LlmServer, calls, text


def imports(run: Run) -> list[str]:
    """The modules the process imported, from its `-X importtime` lines."""
    return [line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")]


def no_litellm(*args: str | Path, env: dict[str, str], stdin: str | None = None) -> Run:
    run = agents(*args, env=env, stdin=stdin, python_flags=("-X", "importtime"))
    assert run.returncode == 0, run.stdout + run.stderr[-300:]
    modules = imports(run)
    assert "celery_agents.cli" in modules  # (main runs as __main__)
    leaked = [m for m in modules if m.split(".")[0] in ("litellm", "openai", "tiktoken", "fastapi", "uvicorn")]
    assert not leaked, f"`agents {' '.join(map(str, args))}` imported {leaked[:5]}"
    return run


@pytest.mark.usefixtures("cli_worker")
def test_queue_mode_commands_without_a_model_call_never_import_litellm(
    llm_server: LlmServer, qenv: dict[str, str], tmp_path: Path
) -> None:
    scenario = llm_server.scenario([calls(("approve", {"x": "1"})), text("ok")])
    agent, _ = write_probe_agent(tmp_path, scenario, llm_server.url)
    view = ok(agents("session", "start", "--agent-file", agent, "-p", "hi", "--run", "--json", env=qenv))
    sid, token = view["session_id"], view["pending"][0]["token"]
    no_litellm("session", "pending", "--json", env=qenv)
    no_litellm("session", "pending", sid, "--json", env=qenv)
    no_litellm("session", "show", sid, "--json", env=qenv)
    no_litellm("session", "list", "--json", env=qenv)
    no_litellm("session", "logs", sid, "--json", env=qenv)
    no_litellm("session", "pause", sid, "--json", env=qenv)
    no_litellm("session", "complete", token, "-", "--json", env=qenv, stdin="yes")
    other = no_litellm("session", "start", "--agent-file", agent, "-p", "hi", "--json", env=qenv).doc["session_id"]
    no_litellm("session", "step", other, "--no-wait", "--json", env=qenv)  # the worker calls the model
    third = ok(agents("session", "start", "--agent-file", agent, "-p", "hi", "--json", env=qenv))["session_id"]
    no_litellm("session", "cancel", third, "--json", env=qenv)
    no_litellm("doctor", "--json", env=qenv)
    no_litellm("--help", env=qenv)


def test_embedded_commands_without_a_model_call_never_import_litellm(tmp_path: Path) -> None:
    env = cli_env(None, "agents", home=tmp_path / "home")
    sid = no_litellm("session", "start", "--agent-file", DEMO_AGENT, "-p", "hi", "--json", env=env).doc["session_id"]
    no_litellm("session", "pending", "--json", env=env)
    no_litellm("session", "show", sid, "--json", env=env)
    no_litellm("session", "list", "--json", env=env)
    no_litellm("session", "logs", sid, "--json", env=env)
    no_litellm("session", "cancel", sid, "--json", env=env)
