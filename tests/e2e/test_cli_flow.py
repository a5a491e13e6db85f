"""The seed's iterative flow, one `agents` process per command, as a person at a shell runs it:
start → step (the model asks for a runSync, a runAsync and a deferred call) → step (the sync call
runs, the async one is dispatched, the deferred one yields a token) → pending → complete → step.

Once in queue mode against a real worker and the scripted model server (every model request and
every tool run counted), and once on the embedded local default from a fresh AGENTS_HOME with the
offline demo agent, where no worker runs at all."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.probe import runs, tool_messages, write_probe_agent
from tests.cli.process import CLI, DEMO_AGENT, agents, check_completion, check_view, cli_env, ok, poll
from tests.e2e.conftest import start_workers
from tests.support.llm_server import LlmServer, calls, text
from tests.support.workers import Worker, pid_alive


@pytest.fixture(scope="module")
def worker(redis_url: str, module_prefix: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    (w,) = start_workers(redis_url, module_prefix, tmp_path_factory.mktemp("cli-flow-logs"))
    yield w
    w.kill()  # nothing is in flight by then; a soft shutdown would only cost seconds


def test_iterative_flow_in_queue_mode(
    worker: Worker, llm_server: LlmServer, redis_url: str, module_prefix: str, tmp_path: Path
) -> None:
    scenario = llm_server.scenario(
        [
            calls(("probe_sync", {"x": "s"}), ("probe_async", {"x": "a"}), ("approve", {"x": "d"})),
            text("booked and checked"),
        ]
    )
    agent, counter = write_probe_agent(tmp_path, scenario, llm_server.url)
    env = cli_env(redis_url, module_prefix)

    started = check_view(
        ok(agents("session", "start", "--agent-file", agent, "-p", "check and book", "--json", env=env))
    )
    sid = started["session_id"]
    assert (started["state"], started["head"]) == ("ready", "UserTurn")
    assert llm_server.count(scenario) == 0

    first = check_view(ok(agents("session", "step", sid, "--json", env=env)))
    assert (first["state"], first["head"], first["steps"]) == ("tools", "LlmTurn", 1)
    assert llm_server.count(scenario) == 1 and runs(counter) == []

    second = check_view(ok(agents("session", "step", sid, "--json", env=env)))
    assert (second["head"], second["steps"]) == ("PartialUserTurn", 2)
    assert second["state"] == "waiting"
    assert "probe_sync" in [line.split()[0] for line in runs(counter)]  # ran inside the step
    deferred = [p for p in second["pending"] if p["disposition"] == "defer"]
    assert [p["tool"] for p in deferred] == ["approve"] and deferred[0]["token"]

    def only_the_deferred_call_left() -> list[dict[str, object]] | None:
        pending = ok(agents("session", "pending", sid, "--json", env=env))["pending"]
        return pending if [p["tool"] for p in pending] == ["approve"] else None

    (listed,) = poll(only_the_deferred_call_left, "the runAsync call to finish on the worker")
    assert listed["token"] == deferred[0]["token"] and listed["state"] == "deferred"

    (tmp_path / "approval.json").write_text('{"approved": true, "by": "alice"}')
    done = check_completion(
        ok(agents("session", "complete", listed["token"], tmp_path / "approval.json", "--json", env=env))
    )
    assert (done["session_id"], done["call_id"], done["remaining"], done["woken"]) == (sid, "call_0_2", 0, False)
    assert llm_server.count(scenario) == 1  # manual drive: nothing moves until the next step

    final = check_view(ok(agents("session", "step", sid, "--json", env=env)))
    assert (final["state"], final["response"], final["pending"]) == ("completed", "booked and checked", [])

    assert llm_server.count(scenario) == 2
    results = tool_messages(llm_server.requests[scenario][-1])
    assert [m["tool_call_id"] for m in results] == ["call_0_0", "call_0_1", "call_0_2"]
    assert [json.loads(m["content"]) for m in results] == [
        {"tool": "probe_sync", "args": {"x": "s"}},
        {"tool": "probe_async", "args": {"x": "a"}},
        {"approved": True, "by": "alice"},
    ]
    assert runs(counter) in (
        ['probe_sync {"x": "s"}', 'probe_async {"x": "a"}'],
        ['probe_async {"x": "a"}', 'probe_sync {"x": "s"}'],
    )
    events = agents("session", "logs", sid, "--json", env=env).lines
    assert [e["type"] for e in events].count("llm_called") == 2


def _server_pid(home: Path) -> int | None:
    try:
        return int((home / "redis.pid").read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def test_iterative_flow_on_the_embedded_default(tmp_path: Path) -> None:
    home = tmp_path / "fresh-home"
    env = cli_env(None, "agents", home=home)
    assert "AGENTS_REDIS_URL" not in env

    started = check_view(
        ok(
            agents(
                "session",
                "start",
                "--agent-file",
                DEMO_AGENT,
                "-p",
                "What is the weather in Paris? Book a table.",
                "--json",
                env=env,
            )
        )
    )
    sid = started["session_id"]
    assert started["state"] == "ready"

    first = check_view(ok(agents("session", "step", sid, "--json", env=env)))
    assert (first["state"], first["head"]) == ("tools", "LlmTurn")
    shown = ok(agents("session", "show", sid, "--json", env=env))
    asked = [c["name"] for c in shown["turns"][-1]["tool_calls"]]
    assert asked == ["get_weather", "get_forecast", "book_table"]

    second = check_view(ok(agents("session", "step", sid, "--json", env=env)))
    # Inline, the CLI ran the runAsync call itself: only the person's booking is left.
    assert (second["state"], second["head"]) == ("waiting", "PartialUserTurn")
    (booking,) = second["pending"]
    assert (booking["tool"], booking["disposition"], booking["state"]) == ("book_table", "defer", "deferred")

    listed = ok(agents("session", "pending", "--json", env=env))["pending"]
    assert [p["token"] for p in listed] == [booking["token"]]

    done = check_completion(
        ok(
            agents(
                "session",
                "complete",
                booking["token"],
                "-",
                "--json",
                env=env,
                stdin='{"confirmed": true, "table": 12}',
            )
        )
    )
    assert (done["remaining"], done["woken"]) == (0, False)

    final = check_view(ok(agents("session", "resume", sid, "--json", env=env)))
    assert final["state"] == "completed"
    assert "Paris" in final["response"] and "Forecast" in final["response"] and '"table": 12' in final["response"]

    shown = ok(agents("session", "show", sid, "--json", env=env))
    assert [t["kind"] for t in shown["turns"]] == ["UserTurn", "LlmTurn", "UserTurn", "LlmTurn"]
    assert [(c["tool"], c["disposition"], c["state"]) for c in shown["calls"]] == [
        ("get_weather", "runSync", "completed"),
        ("get_forecast", "runAsync", "completed"),
        ("book_table", "defer", "completed"),
    ]
    events = agents("session", "logs", sid, "--json", env=env).lines
    assert [e["type"] for e in events].count("llm_called") == 2

    # The data lives under AGENTS_HOME, and no redis-server outlives the commands that used it.
    assert (home / "appendonly.aof").exists() or (home / "appendonlydir").is_dir()  # redis 6 / 7 layouts
    pid = _server_pid(home)
    assert pid is None or poll(lambda: not pid_alive(pid), "the embedded redis-server to stop", timeout=10)
    again = ok(agents("session", "list", "--json", env=env))
    assert [v["session_id"] for v in again["sessions"]] == [sid]


def test_parallel_commands_share_one_embedded_server(tmp_path: Path) -> None:
    """Several shells at once on a fresh AGENTS_HOME: one server, every session kept, none left running."""
    home = tmp_path / "home"
    env = cli_env(None, "agents", home=home)
    argv = [*CLI, "session", "start", "--agent-file", str(DEMO_AGENT), "-p", "hello", "--json"]
    procs = [
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(6)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0] * 6, [err for _, err in outs]
    started = {json.loads(out)["session_id"] for out, _ in outs}
    listed = ok(agents("session", "list", "--json", env=env))["sessions"]
    assert {v["session_id"] for v in listed} == started and len(started) == 6
    pid = _server_pid(home)
    assert pid is None or poll(lambda: not pid_alive(pid), "the embedded redis-server to stop", timeout=10)
