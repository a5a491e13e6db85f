"""runIsolated end to end: a real worker on the `isolated` queue runs the call in the sandbox and
the session completes with the tool's result; then, with no isolated worker at all, the same kind
of call waits until `agents session run-isolated` runs it, and the session completes too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.model import State
from celery_agents.tools import Sandbox, SandboxConfig
from tests.e2e.conftest import wait_for
from tests.support.llm_server import LlmServer, calls, text
from tests.support.workers import Worker, stop_all, worker_env
from tests.tools.conftest import PY, write_program

pytestmark = pytest.mark.slow

SECRET = "sk-e2e-worker-secret"
SHOUT = """
import json, os, sys
args = json.load(sys.stdin)
print(json.dumps({"shout": args["text"].upper(), "env": sorted(os.environ), "uid": os.getuid(),
                  "cwd": os.getcwd()}))
"""


@pytest.fixture(scope="module")
def prefixes() -> dict[str, str]:
    return {"full": f"i{uuid.uuid4().hex[:10]}", "no_isolated": f"n{uuid.uuid4().hex[:10]}"}


@pytest.fixture(scope="module")
def workers(redis_url: str, prefixes: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One worker on every queue (prefix `full`), one on steps and tools only (`no_isolated`),
    started together (a worker takes seconds to boot)."""
    logs = tmp_path_factory.mktemp("worker-logs")
    started = [
        Worker(
            worker_env(redis_url, prefixes["full"], OPENAI_API_KEY=SECRET),
            queues="steps,tools,isolated",
            log=logs / "full.log",
            name=f"full-{uuid.uuid4().hex[:6]}@test",
        ).start(),
        Worker(
            worker_env(redis_url, prefixes["no_isolated"], OPENAI_API_KEY=SECRET),
            queues="steps,tools",
            log=logs / "no-isolated.log",
            name=f"noiso-{uuid.uuid4().hex[:6]}@test",
        ).start(),
    ]
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        for worker, prefix in zip(started, prefixes.values(), strict=True):
            worker.wait_ready(client, prefix)
        yield
    finally:
        stop_all(started)
        client.close()


def settings_for(redis_url: str, prefix: str, home: Path) -> Settings:
    return Settings(redis_url=redis_url, prefix=prefix, home=home, sweep_interval=0.2, owed_grace=2.0)


def isolated_agent(folder: Path, llm_server: LlmServer, scenario: str) -> Path:
    write_program(folder, "shout.py", SHOUT)
    path = folder / "agent.json"
    path.write_text(
        json.dumps(
            {
                "slug": "isolated-e2e",
                "model": f"openai/{scenario}",
                "apiBase": llm_server.url,
                "tools": [
                    {
                        "name": "shout",
                        "description": "Shouts the text back",
                        "parameters": {
                            "type": "object",
                            "properties": {"text": {"type": "string"}},
                            "required": ["text"],
                        },
                        "command": [PY, "shout.py"],
                    }
                ],
                "toolCallPolicy": {
                    "default": "runSync",
                    "rules": [{"tool": "shout", "disposition": {"tag": "runIsolated", "timeoutSeconds": 30}}],
                },
            }
        )
    )
    return path


def tool_answers(request: dict[str, Any]) -> list[Any]:
    return [json.loads(m["content"]) for m in request["messages"] if m["role"] == "tool"]


def check_sandboxed(call: dict[str, Any]) -> None:
    assert (call["state"], call["disposition"], call["attempts"], call["exit_status"]) == (
        "completed",
        "runIsolated",
        1,
        0,
    ), call["error"]
    assert call["duration_ms"] > 0 and call["meta"]["isolation"] in ("namespaces", "bwrap")
    result = call["result"]
    assert result["shout"] == "HELLO"
    assert "OPENAI_API_KEY" not in result["env"] and "AGENTS_REDIS_URL" not in result["env"]
    assert Path(result["cwd"]).name.startswith("agents-sandbox-") and not Path(result["cwd"]).exists()


def test_an_isolated_worker_runs_the_call_and_the_session_completes(
    workers: None, redis_url: str, prefixes: dict[str, str], llm_server: LlmServer, tooldir: Path, tmp_path: Path
) -> None:
    scenario = llm_server.scenario([calls(("shout", {"text": "hello"})), text("it shouted HELLO")])
    agent = isolated_agent(tooldir, llm_server, scenario)
    with Client(settings_for(redis_url, prefixes["full"], tmp_path), inline=False) as client:
        view = client.start(agent, "shout hello", run=True, timeout=90)
        assert (view.state, view.response) == (State.COMPLETED, "it shouted HELLO")
        (call,) = client.show(view.session_id).calls or []
    check_sandboxed(call)
    (answer,) = tool_answers(llm_server.requests[scenario][-1])
    assert answer["shout"] == "HELLO", "the model got the sandboxed tool's result"


def test_without_an_isolated_worker_run_isolated_runs_the_call(
    workers: None, redis_url: str, prefixes: dict[str, str], llm_server: LlmServer, tooldir: Path, tmp_path: Path
) -> None:
    prefix = prefixes["no_isolated"]
    scenario = llm_server.scenario([calls(("shout", {"text": "hello"})), text("shouted by hand")])
    agent = isolated_agent(tooldir, llm_server, scenario)
    with Client(settings_for(redis_url, prefix, tmp_path), inline=False) as client:
        sid = client.start(agent, "shout hello", run=True, wait=False).session_id
        pending = wait_for(
            lambda: [p for p in client.pending(sid) if p.disposition == "runIsolated"],
            timeout=60,
            what="the isolated call to wait for a worker that is absent",
        )
        assert [p.tool for p in pending] == ["shout"] and client.show(sid).state == State.WAITING

        cli = subprocess.run(
            [sys.executable, "-m", "celery_agents.cli", "session", "run-isolated", sid, "--json"],
            env=worker_env(redis_url, prefix, OPENAI_API_KEY=SECRET),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert cli.returncode == 0, cli.stderr
        shown = json.loads(cli.stdout)
        assert shown["session_id"] == sid and shown["pending"] == []

        done = wait_for(
            lambda: (v := client.show(sid)).state == State.COMPLETED and v,
            timeout=60,
            what="the woken session to complete",
        )
        assert done.response == "shouted by hand"
        (call,) = done.calls or []
    check_sandboxed(call)
    (answer,) = tool_answers(llm_server.requests[scenario][-1])
    assert answer["shout"] == "HELLO"


def test_doctor_says_how_each_isolated_worker_confines_calls(
    workers: None, redis_url: str, prefixes: dict[str, str], tmp_path: Path
) -> None:
    from tests.cli.process import agents, cli_env

    full = agents("doctor", "--json", env=cli_env(redis_url, prefixes["full"], tmp_path / "home")).doc
    [sandbox] = [c for c in full["checks"] if c["name"].startswith("sandbox on full-")]
    [beat] = [w for w in full["workers"] if w["name"].startswith("full-")]
    here = Sandbox(SandboxConfig())
    how = here.containment()
    expected = {
        "contained": how is not None,
        "bubblewrap": how == "bwrap",
        "namespaces": how == "namespaces",
        "own_uid": os.geteuid() == 0,
        "run_cgroup": here.cgroups.available(),
    }
    assert beat["sandbox"] == expected, "the worker probed what this machine offers"
    assert ("bubblewrap (filesystem and network hidden)" in sandbox["detail"]) == expected["bubblewrap"]
    assert ("a cgroup per call" in sandbox["detail"]) == expected["run_cgroup"]
    other = agents("doctor", "--json", env=cli_env(redis_url, prefixes["no_isolated"], tmp_path / "home")).doc
    assert not [c for c in other["checks"] if c["name"].startswith("sandbox on")], "it runs no isolated calls"
