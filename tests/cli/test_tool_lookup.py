"""One rule for where tools are found, the same under every disposition and on every worker: a
python tool in a module beside the agent file imports inline (runSync) and on a tools worker
(runAsync) as it does in the sandbox; `{python}` in a command is the interpreter celery-agents
runs on, so the demo works with no `python3` on PATH."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.cli.process import DEMO_AGENT, agents, ok
from tests.support.llm_server import LlmServer, Reply, calls, text

pytestmark = pytest.mark.usefixtures("cli_worker")


def both_then_answer(request: dict[str, Any]) -> Reply:
    if request["messages"][-1]["role"] == "tool":
        return text("done")
    return calls(("shout_sync", {"words": "hi"}), ("shout_async", {"words": "ho"}))


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "workers"])
def test_a_python_tool_beside_the_agent_file_runs_under_every_disposition(
    llm_server: LlmServer, qenv: dict[str, str], tmp_path: Path, inline: bool
) -> None:
    module = f"beside_{uuid.uuid4().hex[:8]}"  # not importable from anywhere but the agent's folder
    (tmp_path / f"{module}.py").write_text("def shout(words: str) -> str:\n    return words.upper() + '!'\n")
    agent = tmp_path / "agent.json"
    scenario = llm_server.scenario([both_then_answer])
    agent.write_text(
        json.dumps(
            {
                "slug": "beside",
                "model": f"openai/{scenario}",
                "apiBase": llm_server.url,
                "tools": [
                    {"name": "shout_sync", "python": f"{module}:shout"},
                    {"name": "shout_async", "python": f"{module}:shout"},
                ],
                "toolCallPolicy": {"rules": [{"tool": "shout_async", "disposition": "runAsync"}]},
            }
        )
    )
    run = ok(agents("run", "--agent-file", agent, "-p", "x", "--json", *(["--inline"] if inline else []), env=qenv))
    view = ok(agents("session", "show", run["session_id"], "--json", env=qenv))
    results = {c["tool"]: (c["state"], c.get("result"), c.get("error")) for c in view["calls"]}
    assert results == {"shout_sync": ("completed", "HI!", None), "shout_async": ("completed", "HO!", None)}, results
    # The model saw the signature as the schema: the module was found the same way at load time.
    [first, *_] = llm_server.requests[scenario]
    seen = {t["function"]["name"]: t["function"]["parameters"] for t in first["tools"]}
    assert seen["shout_sync"]["properties"] == {"words": {"type": "string"}}, seen


def test_the_demo_command_tool_runs_on_our_interpreter_not_python3_from_path(
    qenv: dict[str, str], tmp_path: Path
) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    impostor = fake / "python3"
    impostor.write_text("#!/bin/sh\necho 'the wrong python3' >&2\nexit 1\n")
    impostor.chmod(0o755)
    env = {**qenv, "PATH": f"{fake}{os.pathsep}{qenv.get('PATH', '')}"}
    run = ok(
        agents("run", "--agent-file", DEMO_AGENT, "-p", "What is the weather in Paris?", "--inline", "--json", env=env)
    )
    view = ok(agents("session", "show", run["session_id"], "--json", env=qenv))
    [forecast] = [c for c in view["calls"] if c["tool"] == "get_forecast"]
    assert forecast["state"] == "completed", forecast
