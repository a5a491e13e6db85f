"""`session run-isolated` runs, in this process, the runIsolated calls no isolated worker took
(the package's worker consumes only `steps,tools`), and `session logs --follow` shows it happen."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from pathlib import Path

import pytest
import redis

from tests.cli.probe import tool_messages, write_probe_agent
from tests.cli.process import CLI, agents, check_view, ok, poll
from tests.support.interrupt import sigint_default
from tests.support.llm_server import LlmServer, calls, text

pytestmark = pytest.mark.usefixtures("cli_worker")


def test_run_isolated_runs_the_calls_here_and_logs_follow_shows_it(
    llm_server: LlmServer, qenv: dict[str, str], cli_redis: redis.Redis, cli_prefix: str, tmp_path: Path
) -> None:
    scenario = llm_server.scenario([calls(("probe_iso", {"x": "i"})), text("isolated result seen")])
    agent, _ = write_probe_agent(tmp_path, scenario, llm_server.url)
    sid = ok(agents("session", "start", "--agent-file", agent, "-p", "sandbox it", "--json", env=qenv))["session_id"]
    ok(agents("session", "step", sid, "--json", env=qenv))
    queued = cli_redis.llen(f"{cli_prefix}:celery:isolated")
    waiting = check_view(ok(agents("session", "step", sid, "--json", env=qenv)))
    assert waiting["state"] == "waiting"
    assert [(p["tool"], p["disposition"]) for p in waiting["pending"]] == [("probe_iso", "runIsolated")]
    # Dispatched (the worker publishes the call just after the commit the step's view shows), and
    # nobody consumes it: no worker here serves the isolated queue.
    poll(lambda: cli_redis.llen(f"{cli_prefix}:celery:isolated") == queued + 1, "the call's message to be queued")

    follower = subprocess.Popen(
        [*CLI, "session", "logs", sid, "--follow", "--json"],
        env=qenv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_default,  # Ctrl-C reaches it also from a run that ignores SIGINT
    )
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(iter(follower.stdout.readline, "")), daemon=True)
    reader.start()

    def follower_printed(kind: str) -> bool:
        return any(json.loads(line)["type"] == kind for line in list(seen))

    try:
        poll(lambda: follower_printed("step_committed"), "the follower to print the history")
        ran = check_view(ok(agents("session", "run-isolated", sid, "--json", env=qenv)))
        assert (ran["state"], ran["pending"]) == ("ready", [])
        poll(lambda: follower_printed("tool_finished"), "the follower to print the isolated call finishing")
    finally:
        follower.send_signal(signal.SIGINT)
        follower.wait(timeout=10)
        reader.join(timeout=5)
    assert follower.returncode == 130, follower.stderr.read() if follower.stderr else ""

    shown = ok(agents("session", "show", sid, "--json", env=qenv))
    (call,) = shown["calls"]
    assert (call["state"], call["result"]) == ("completed", {"tool": "probe_iso", "args": {"x": "i"}}), call
    done = check_view(ok(agents("session", "step", sid, "--json", env=qenv)))
    assert (done["state"], done["response"]) == ("completed", "isolated result seen")
    (result,) = tool_messages(llm_server.requests[scenario][-1])
    assert json.loads(result["content"]) == {"tool": "probe_iso", "args": {"x": "i"}}
