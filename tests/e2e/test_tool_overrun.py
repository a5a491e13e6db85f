"""A python tool that runs inside the worker (runAsync here) and ignores its timeout: the call
fails as timed out, the session goes on, and the pool process whose thread is still running it is
replaced once its task has recorded the outcome, so the runaway does not live on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from tests.e2e.conftest import start_workers, wait_for
from tests.support.llm_server import LlmServer, calls, text
from tests.support.workers import pid_alive

pytestmark = pytest.mark.slow


def test_a_python_tool_past_its_timeout_does_not_outlive_its_pool_process(
    workers: Any, module_settings: Settings, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    pidfile = tmp_path / "spin.pid"
    scenario = llm_server.scenario([calls(("spin", {"pidfile": str(pidfile)})), text("it never answered")])
    agent = write_agent(
        {
            "slug": "spin",
            "model": f"openai/{scenario}",
            "apiBase": llm_server.url,
            "tools": [{"name": "spin", "description": "spins", "python": "tests.tools.sample_tools:spin"}],
            "toolCallPolicy": {"default": {"tag": "runAsync", "timeoutSeconds": 1}},
        }
    )
    with Client(module_settings, inline=False) as client:
        seen: list[tuple[str, int]] = []
        view = client.start(
            agent, "spin", run=True, timeout=60, on_event=lambda e: seen.append((e["type"], e["version"]))
        )
        assert view.state.value == "completed" and view.response == "it never answered", (view, seen)
        [call] = client.show(view.session_id).calls or []
        assert call["state"] == "failed" and "did not finish within 1 s" in call["error"], call
    pid = int(pidfile.read_text())
    wait_for(lambda: not pid_alive(pid), timeout=30, what=f"pool process {pid}, still running the tool, to be replaced")
    # The pool carries on with a fresh process.
    with Client(module_settings, inline=False) as client:
        again = client.start(agent, "spin", run=True, timeout=60)
        assert again.state.value == "completed"


def test_a_runsync_python_tool_past_its_timeout_replaces_its_steps_process(
    redis_url: str, prefix: str, settings: Settings, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    """runSync runs in a steps process (threads pool): the runaway thread cannot be killed there,
    so the process finishes its steps in flight and leaves, and the supervisor starts a fresh one."""
    pidfile = tmp_path / "spin.pid"
    scenario = llm_server.scenario([calls(("spin", {"pidfile": str(pidfile)})), text("it never answered")])
    agent = write_agent(
        {
            "slug": "spin-sync",
            "model": f"openai/{scenario}",
            "apiBase": llm_server.url,
            "tools": [{"name": "spin", "description": "spins", "python": "tests.tools.sample_tools:spin"}],
            "toolCallPolicy": {"default": {"tag": "runSync", "timeoutSeconds": 1}},
        }
    )
    [worker] = start_workers(redis_url, prefix, tmp_path, queues="steps")
    try:
        assert worker.proc is not None
        with Client(settings, inline=False) as client:
            view = client.start(agent, "spin", run=True, timeout=90)
            assert view.state.value == "completed" and view.response == "it never answered", view
            [call] = client.show(view.session_id).calls or []
            assert call["state"] == "failed" and "did not finish within 1 s" in call["error"], call
        pid = int(pidfile.read_text())
        wait_for(lambda: not pid_alive(pid), timeout=60, what=f"steps process {pid}, still running the tool, to leave")
        assert worker.proc.poll() is None, "the supervisor stays"
        # A fresh steps process serves the next session.
        with Client(settings, inline=False) as client:
            again = client.start(agent, "spin", run=True, timeout=90)
            assert again.state.value == "completed"
    finally:
        worker.stop()
