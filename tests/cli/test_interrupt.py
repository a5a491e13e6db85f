"""Ctrl-C during `agents run`: the session id is printed before the model is called, and the
interrupted command says what became of the session — paused (inline: nothing else drives it)
or going on (workers) — and how to continue it."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from tests.cli.probe import write_probe_agent
from tests.cli.process import CLI, agents, ok, poll
from tests.support.interrupt import sigint_default
from tests.support.llm_server import LlmServer, Reply, text

pytestmark = pytest.mark.usefixtures("cli_worker")


class Running:
    """An `agents` process whose stderr is read line by line as it comes."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [*CLI, *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=sigint_default,  # Ctrl-C reaches it also from a run that ignores SIGINT
        )
        self.lines: list[str] = []
        self._seen = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._seen:
                self.lines.append(line.rstrip("\n"))
                self._seen.notify_all()

    def wait_for_line(self, start: str, timeout: float = 60) -> str:
        with self._seen:
            found = self._seen.wait_for(lambda: any(x.startswith(start) for x in self.lines), timeout)
        assert found, f"no line starting {start!r} within {timeout} s: {self.lines}"
        return next(x for x in self.lines if x.startswith(start))

    def interrupt(self) -> tuple[int, str, str]:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=60)
        self._reader.join(timeout=10)
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()
        return self.proc.returncode, out, "\n".join(self.lines)


def slow_agent(llm_server: LlmServer, folder: Path, first: Reply, then: Reply) -> tuple[Path, str]:
    scenario = llm_server.scenario([first, then])
    agent, _ = write_probe_agent(folder, scenario, llm_server.url)
    return agent, scenario


def test_ctrl_c_inline_pauses_the_session_and_says_how_to_resume(
    llm_server: LlmServer, qenv: dict[str, str], tmp_path: Path
) -> None:
    agent, scenario = slow_agent(llm_server, tmp_path, text("too late", delay=60), text("resumed answer"))
    running = Running(["run", "--agent-file", str(agent), "-p", "hello", "--inline"], qenv)
    sid = running.wait_for_line("session ").split()[1]
    poll(lambda: llm_server.count(scenario) == 1, "the model to be called", timeout=60)
    code, out, err = running.interrupt()
    assert code == 130, err
    assert out == ""
    assert f"session {sid} was paused" in err and f"agents session resume {sid}" in err, err
    view = ok(agents("session", "show", sid, "--json", env=qenv))
    assert view["state"] == "ready" and view["steps"] == 0, view  # nothing half-done was committed
    resumed = agents("session", "resume", sid[:8], "--inline", env=qenv)
    assert resumed.returncode == 0 and resumed.stdout.endswith("answer: resumed answer\n"), str(resumed)


def test_ctrl_c_with_json_prints_the_sessions_view_as_the_one_document(
    llm_server: LlmServer, qenv: dict[str, str], tmp_path: Path
) -> None:
    """A program reading `--json` gets a document on Ctrl-C too: the session as it is now (inline:
    paused, nothing half-done committed); the words stay on stderr."""
    agent, scenario = slow_agent(llm_server, tmp_path, text("too late", delay=60), text("resumed answer"))
    running = Running(["run", "--agent-file", str(agent), "-p", "hello", "--inline", "--json"], qenv)
    poll(lambda: llm_server.count(scenario) == 1, "the model to be called", timeout=60)
    code, out, err = running.interrupt()
    assert code == 130, err
    view = json.loads(out)
    assert (view["state"], view["steps"], view["drive"]) == ("ready", 0, "manual"), view
    assert f"session {view['session_id']} was paused" in err, err


def test_an_interrupted_inline_step_stays_paused_with_a_worker_sweeping_the_same_redis(
    llm_server: LlmServer, qenv: dict[str, str], tmp_path: Path
) -> None:
    """The package's worker sweeps this prefix every 0.2 s and republishes any step owed that no
    lease holds. The interrupted command stops for 3 s just after letting its step's lease go
    (checkpoint `step_interrupted`): the pause must already hold by then, or the worker takes the
    step up and calls the model the person stopped."""
    agent, scenario = slow_agent(llm_server, tmp_path, text("too late", delay=60), text("not asked for"))
    env = {**qenv, "AGENTS_FAULT_PAUSE": "step_interrupted", "AGENTS_FAULT_PAUSE_SECONDS": "3"}
    running = Running(["run", "--agent-file", str(agent), "-p", "hello", "--inline"], env)
    sid = running.wait_for_line("session ").split()[1]
    poll(lambda: llm_server.count(scenario) == 1, "the model to be called", timeout=60)
    code, _, err = running.interrupt()
    assert code == 130 and f"session {sid} was paused" in err, err
    view = ok(agents("session", "show", sid, "--json", env=qenv))
    assert view["state"] == "ready" and view["steps"] == 0, view
    assert llm_server.count(scenario) == 1, "a worker called the model for a paused session"
    logs = agents("session", "logs", sid, "--json", env=qenv)
    assert logs.returncode == 0, str(logs)
    events = [e["type"] for e in logs.lines]
    assert events.count("paused") == 1, events


def test_ctrl_c_with_workers_leaves_the_session_going_on(
    llm_server: LlmServer, qenv: dict[str, str], tmp_path: Path
) -> None:
    agent, _ = slow_agent(llm_server, tmp_path, text("slow answer", delay=4), text("slow answer"))
    running = Running(["run", "--agent-file", str(agent), "-p", "hello"], qenv)
    sid = running.wait_for_line("session ").split()[1]
    code, _, err = running.interrupt()
    assert code == 130, err
    assert f"session {sid} goes on" in err and f"agents session logs {sid} --follow" in err, err
    done = poll(
        lambda: (v := ok(agents("session", "show", sid, "--json", env=qenv)))["state"] == "completed" and v,
        "the workers to finish the session",
        timeout=60,
    )
    assert done["response"] == "slow answer"
