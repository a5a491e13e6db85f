"""A python tool that ignores its timeout, run by a real worker (runAsync in a tools pool process,
runSync in a steps process): the call fails as timed out, the session goes on, and the tool's own
process (a child interpreter) is killed at the timeout — the worker's processes stay and serve the
next call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from tests.e2e.conftest import wait_for
from tests.e2e.test_worker_processes import descendants
from tests.support.llm_server import LlmServer, calls, text
from tests.support.workers import Worker, pid_alive

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("disposition", ["runAsync", "runSync"])
def test_a_python_tool_past_its_timeout_is_killed_and_the_worker_goes_on(
    disposition: str,
    workers: list[Worker],
    module_settings: Settings,
    llm_server: LlmServer,
    write_agent: Any,
    tmp_path: Path,
) -> None:
    pidfile = tmp_path / "spin.pid"
    spin, quick = calls(("spin", {"pidfile": str(pidfile)})), calls(("quick", {"a": 1, "b": 2}))
    scenario = llm_server.scenario([spin, text("it never answered"), quick, text("3")])
    agent = write_agent(
        {
            "slug": f"spin-{disposition.lower()}",
            "model": f"openai/{scenario}",
            "apiBase": llm_server.url,
            "tools": [
                {"name": "spin", "description": "spins", "python": "tests.tools.sample_tools:spin"},
                {"name": "quick", "description": "adds", "python": "tests.tools.sample_tools:add"},
            ],
            # Room for the tool's process to start and write its pid first, and more for the
            # quick call: on a machine busy with other tests (load 9 on 2 cores) a forked tool
            # took over a second to start, and was killed before it ran.
            "toolCallPolicy": {
                "default": {"tag": disposition, "timeoutSeconds": 4},
                "rules": [{"tool": "quick", "disposition": {"tag": disposition, "timeoutSeconds": 30}}],
            },
        }
    )
    processes = {p for w in workers for p in descendants(w.proc.pid)}
    with Client(module_settings, inline=False) as client:
        view = client.start(agent, "spin", run=True, timeout=60)
        assert view.state.value == "completed" and view.response == "it never answered", view
        [call] = client.show(view.session_id).calls or []
        assert call["state"] == "failed" and "did not finish within 4 s and was killed" in call["error"], call
        pid = int(pidfile.read_text())
        wait_for(lambda: not pid_alive(pid), timeout=10, what=f"the tool's process {pid} to be gone")
        again = client.send(view.session_id, "add", run=True, timeout=60)
        assert again.response == "3"
        quick_call = [c for c in client.show(view.session_id).calls or [] if c["tool"] == "quick"]
        assert [(c["state"], c["result"]) for c in quick_call] == [("completed", 3)], "the worker serves the next call"
    # (its python tools' fork server may have joined them)
    assert processes <= {p for w in workers for p in descendants(w.proc.pid)}, "no worker process was replaced"
