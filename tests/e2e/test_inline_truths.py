"""Inline mode (no worker) does what its messages say: a completion that makes a session due says
who will continue it and what to run; an interrupted inline step does not hold the session; a
session stopped by its step limit completes on `resume`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.llm import LitellmPort
from celery_agents.scheduler.ports import LlmRequest
from tests.chaos.invariants import check_invariants
from tests.cli.process import DEMO_AGENT, agents, cli_env
from tests.support.llm_server import LlmServer, Reply, calls, text


def one_tool_then_answer(body: dict[str, Any]) -> Reply:
    if body["messages"][-1]["role"] == "tool":
        return text("done")
    return calls(("get_weather", {"city": "Paris"}))


def echo_agent(llm_server: LlmServer, write_agent: Any, **extra: Any) -> Path:
    scenario = llm_server.scenario([one_tool_then_answer])
    path: Path = write_agent(
        {
            "slug": "truths",
            "model": f"openai/{scenario}",
            "apiBase": llm_server.url,
            "tools": [{"name": "get_weather", "python": "celery_agents.tools.demo:get_weather"}],
            **extra,
        }
    )
    return path


def test_complete_without_a_worker_says_what_to_run_and_that_runs_it(tmp_path: Path, prefix: str) -> None:
    env = cli_env(None, prefix, tmp_path / "home")  # the embedded local default: no worker
    prompt = "What is the weather in Paris? Book a table on a terrace."
    run = agents("session", "start", "--agent-file", DEMO_AGENT, "-p", prompt, "--run", "--json", env=env)
    assert run.returncode == 0, run
    view = run.doc
    assert view["state"] == "waiting"
    token = next(p["token"] for p in view["pending"] if p["token"])
    (tmp_path / "booking.json").write_text('{"booked": true}')
    done = agents("session", "complete", token, tmp_path / "booking.json", env=env)
    assert done.returncode == 0, done
    said = done.stdout + done.stderr
    assert "continues on its own" not in said, said
    assert f"agents session resume {view['session_id']}" in said, said
    resumed = agents("session", "resume", view["session_id"], "--json", env=env)
    assert resumed.doc["state"] == "completed", resumed


def test_an_interrupted_inline_step_does_not_hold_the_session(
    settings: Settings, llm_server: LlmServer, write_agent: Any
) -> None:
    path = echo_agent(llm_server, write_agent)

    class CtrlC(LitellmPort):
        def complete(self, request: LlmRequest) -> Any:
            raise KeyboardInterrupt  # what SIGINT raises in the main thread, mid model call

    with Client(settings, inline=True, llm=CtrlC()) as client:
        sid = ""

        def created(session_id: str) -> None:
            nonlocal sid
            sid = session_id

        try:
            client.start(path, "go", run=True, on_created=created)
            raise AssertionError("the interrupt was swallowed")
        except KeyboardInterrupt:
            pass
    with Client(settings, inline=True) as later:  # the next command, in another process
        later.owner = "cli@elsewhere:1"
        view = later.resume(sid)
        assert view.state.value == "completed", view
        check_invariants(later.store, sid)


def test_a_session_stopped_by_max_steps_completes_on_resume(
    settings: Settings, llm_server: LlmServer, write_agent: Any
) -> None:
    path = echo_agent(llm_server, write_agent, maxSteps=1)
    with Client(settings, inline=True) as client:
        view = client.start(path, "go", run=True)
        assert view.state.value == "failed" and view.error is not None and view.error.code == "max_steps"
        steps_at_stop = view.steps
        view = client.resume(view.session_id)
        assert view.state.value == "completed", f"resume ended {view.state.value}: {view.error}"
        assert view.steps == steps_at_stop + 1, "the refused attempt is not a step; resume granted one more"
        check_invariants(client.store, view.session_id)
