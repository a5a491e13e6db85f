"""Inline mode (no worker): a dispatched call whose runner died is run by the next command."""

from __future__ import annotations

from pathlib import Path

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.llm import LitellmPort
from celery_agents.runtime import run_step
from celery_agents.tools import ToolRunner
from celery_agents.tools.resolve import load_agent_file

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo-agent.json"


def test_resume_runs_a_dispatched_call_left_behind(settings: Settings) -> None:
    with Client(settings, inline=True) as client:
        store = client.store
        sid = client.start(load_agent_file(DEMO), "What is the weather in Paris?", run=False).session_id
        llm, tools = LitellmPort(), ToolRunner()
        run_step(store, sid, 1, llm=llm, tools=tools, owner="dead-cli")
        committed = run_step(store, sid, 2, llm=llm, tools=tools, owner="dead-cli")
        # The process that committed this step died before running the runAsync call it dispatched.
        assert [c.tool for c in committed.dispatch] == ["get_forecast"]
        assert [c.state.value for c in store.pending_calls(sid)] == ["running"]

        view = client.resume(sid)
        assert view.state.value == "completed"
        assert "Forecast for Paris" in (view.response or "")
        forecast = next(c for c in store.calls(sid) if c.tool == "get_forecast")
        assert forecast.state.value == "completed" and forecast.attempts == 1
