"""Python tools: schema declared or derived from the signature, argument checks, exceptions,
timeouts, media, and the child interpreter every call runs in (with the allow-listed environment,
or in the sandbox for runIsolated)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from celery_agents.tools import ToolRunner
from celery_agents.tools.resolve import parse_agent
from celery_agents.tools.sandbox import reachable_by_others
from tests.support.workers import pid_alive
from tests.tools.conftest import make_agent, run_tool
from tests.tools.sample_tools import PNG_1PX

MOD = "tests.tools.sample_tools"


def test_the_schema_is_derived_from_the_signature_when_none_is_declared() -> None:
    agent = make_agent([{"name": "forecast", "python": f"{MOD}:forecast"}])
    tool = agent.tools[0]
    assert tool.parameters == {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer", "default": 3},
            "unit": {"enum": ["C", "F"], "type": "string", "default": "C"},
        },
        "required": ["city"],
        "additionalProperties": False,
    }
    assert tool.description == "The forecast for a city.", "the docstring's first paragraph"
    assert tool.openai_schema()["function"]["parameters"] == tool.parameters
    # The stored form carries the schema: a worker never needs to import the module to describe it.
    again = type(agent).from_json(agent.to_json())
    assert again.tools[0].parameters == tool.parameters


def test_a_declared_schema_is_kept_and_enforced() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "maximum": 10}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    }
    agent = make_agent([{"name": "add", "python": f"{MOD}:add", "parameters": schema}])
    assert agent.tools[0].parameters == schema
    runner = ToolRunner()
    assert run_tool(runner, agent, "add", {"a": 2, "b": 3}).result == 5
    out = run_tool(runner, agent, "add", {"a": 20, "b": 3})
    assert out.state == "failed" and "a: 20 is greater than the maximum of 10" in out.error
    assert runner.executions == 1, "bad arguments never run the function"


def test_bad_arguments_become_a_message_the_model_can_act_on() -> None:
    agent = make_agent([{"name": "forecast", "python": f"{MOD}:forecast"}])
    out = run_tool(ToolRunner(), agent, "forecast", {"town": "Paris", "unit": "K"})
    assert out.state == "failed" and out.attempts == 0
    assert "'city' is a required property" in out.error
    assert "'town' was unexpected" in out.error
    assert "unit: 'K' is not one of ['C', 'F']" in out.error
    assert "Call forecast again with corrected arguments" in out.error


def test_arguments_are_bound_to_the_signature_even_with_a_loose_schema() -> None:
    agent = make_agent([{"name": "add", "python": f"{MOD}:add", "parameters": {"type": "object", "properties": {}}}])
    out = run_tool(ToolRunner(), agent, "add", {"a": 1, "b": "not a number"})
    assert out.state == "failed" and out.meta.invalid_arguments
    assert out.error.startswith("b: Input should be a valid integer")


def test_an_exception_becomes_the_error_text() -> None:
    agent = make_agent([{"name": "explode", "python": f"{MOD}:explode"}])
    out = run_tool(ToolRunner(), agent, "explode", {"reason": "too windy"})
    assert (out.state, out.error) == ("failed", "ValueError: cannot do that: too windy")
    assert out.meta.retryable is False


def test_an_exception_marked_retryable_is_retried(tmp_path: Path) -> None:
    agent = make_agent(
        [{"name": "flaky", "python": f"{MOD}:flaky"}],
        rules=[{"tool": "flaky", "disposition": {"tag": "runSync", "retries": 3, "backoffSeconds": 0.01}}],
        executionMode="synchronous",
    )
    out = run_tool(ToolRunner(), agent, "flaky", {"key": str(tmp_path / "attempts"), "failures": 2})
    assert (out.state, out.result, out.attempts) == ("completed", "ok after 3", 3)
    assert out.meta.earlier_attempts == ["FlakyError: temporary failure 1", "FlakyError: temporary failure 2"]


def test_a_python_tool_past_its_timeout_is_killed(tmp_path: Path) -> None:
    agent = make_agent(
        [{"name": "hang", "python": f"{MOD}:hang"}],
        rules=[{"tool": "hang", "disposition": {"tag": "runSync", "timeoutSeconds": 0.5}}],
        executionMode="synchronous",
    )
    pidfile = tmp_path / "hang.pid"
    started = time.monotonic()
    out = run_tool(ToolRunner(), agent, "hang", {"pidfile": str(pidfile)})
    assert out.state == "failed" and out.meta.timed_out
    assert "did not finish within 0.5 s and was killed" in out.error
    assert time.monotonic() - started < 5
    pid = int(pidfile.read_text())
    assert pid != os.getpid() and not pid_alive(pid), "the tool's process is gone, the worker goes on"


def test_a_python_tool_runs_in_a_child_with_the_allow_listed_environment_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-worker-secret")
    monkeypatch.setenv("AGENTS_REDIS_URL", "redis://:secret@127.0.0.1:1/0")
    monkeypatch.setenv("GITHUB_TOKEN", "ghp-named")
    monkeypatch.setenv("SHARED_VAR", "shared")
    agent = make_agent([{"name": "whoami", "python": f"{MOD}:whoami", "env": ["GITHUB_TOKEN"]}])
    out = run_tool(ToolRunner(tool_env=("SHARED_VAR",)), agent, "whoami")
    assert out.state == "completed", out.error
    assert out.result["pid"] != os.getpid()
    allowed = {"PATH", "HOME", "LANG", "LC_ALL", "TZ", "GITHUB_TOKEN", "SHARED_VAR"}
    allowed |= {"AGENTS_SESSION_ID", "AGENTS_CALL_ID", "AGENTS_IDEMPOTENCY_KEY"}
    # What the interpreter adds itself (LC_CTYPE when it coerces a C locale) is no variable of the worker's.
    assert set(out.result["env"]) - {"LC_CTYPE"} <= allowed, out.result["env"]
    assert {"GITHUB_TOKEN", "SHARED_VAR", "AGENTS_CALL_ID"} <= set(out.result["env"])


def test_an_image_returned_by_a_function_becomes_media() -> None:
    agent = make_agent([{"name": "picture", "python": f"{MOD}:picture"}, {"name": "mixed", "python": f"{MOD}:mixed"}])
    out = run_tool(ToolRunner(), agent, "picture", {"caption": "dot"})
    assert [(m.mime_type, m.data_base64, m.filename) for m in out.media] == [("image/png", PNG_1PX, "dot.png")]
    out = run_tool(ToolRunner(), agent, "mixed")
    assert out.result == "here is the chart" and [m.mime_type for m in out.media] == ["image/png"]


def test_an_unimportable_function_fails_the_call_not_the_agent_file() -> None:
    agent = parse_agent(
        {"slug": "x", "model": "m", "tools": [{"name": "lookup", "python": "no_such_pkg.tools:lookup"}]}
    )
    assert agent.tools[0].parameters == {"type": "object", "properties": {}}
    out = run_tool(ToolRunner(), agent, "lookup")
    assert out.state == "failed" and out.error.startswith("cannot load no_such_pkg.tools:lookup")


def test_isolated_python_tools_run_in_a_child_interpreter_without_the_worker_environment(
    monkeypatch: pytest.MonkeyPatch, isolated: ToolRunner, level: str
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-worker-secret")
    monkeypatch.setenv("AGENTS_REDIS_URL", "redis://:secret@127.0.0.1:1/0")
    agent = make_agent(
        [{"name": "whoami", "python": f"{MOD}:whoami"}, {"name": "forecast", "python": f"{MOD}:forecast"}]
    )
    runner = isolated
    out = run_tool(runner, agent, "whoami")
    if level == "namespaces" and os.geteuid() == 0 and not reachable_by_others(sys.executable):
        # A root worker gives every call a uid of its own; without bubblewrap that uid cannot
        # start an interpreter under a 0700 folder, and the call is refused rather than run as root.
        assert out.state == "failed" and "an isolated call never runs as root" in (out.error or ""), out.error
        return
    assert out.state == "completed", out.error
    assert out.result["pid"] != os.getpid()
    assert "OPENAI_API_KEY" not in out.result["env"] and "AGENTS_REDIS_URL" not in out.result["env"]
    assert out.result["home"] == out.result["cwd"] and not os.path.exists(out.result["cwd"])
    assert out.meta.isolation == level
    bad = run_tool(runner, agent, "forecast", {"city": 3})
    assert bad.state == "failed" and "city: 3 is not of type 'string'" in bad.error


def test_a_setting_of_the_worker_reaches_no_tool_even_when_named_to_every_tool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings refuse an AGENTS_TOOL_ENV naming one; the runner itself drops it all the same."""
    monkeypatch.setenv("AGENTS_REDIS_URL", "redis://:secret@127.0.0.1:1/0")
    agent = make_agent(
        [
            {"name": "whoami", "python": f"{MOD}:whoami"},
            {
                "name": "env",
                "command": [sys.executable, "-c", "import json, os; print(json.dumps(sorted(os.environ)))"],
            },
        ]
    )
    runner = ToolRunner(tool_env=("AGENTS_REDIS_URL",))
    assert "AGENTS_REDIS_URL" not in run_tool(runner, agent, "whoami").result["env"]
    assert "AGENTS_REDIS_URL" not in run_tool(runner, agent, "env").result


def test_calls_from_many_threads_each_get_their_own_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A steps process calls python tools from hundreds of threads: one fork server (the tool
    module's) serves them."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv("OPENAI_API_KEY", "sk-worker-secret")
    agent = make_agent([{"name": "add", "python": f"{MOD}:add"}])
    runner = ToolRunner()

    def call(n: int) -> tuple[int, Any]:
        out = run_tool(runner, agent, "add", {"a": n, "b": 1000})
        return n, out.result if out.state == "completed" else out.error

    with ThreadPoolExecutor(8) as pool:
        answers = dict(pool.map(call, range(80)))
    assert answers == {n: n + 1000 for n in range(80)}
    from celery_agents.tools.forkserver import warm_servers

    servers = [s.pid for s in warm_servers() if s.module == MOD and s.pid]
    assert servers, "the tool module's fork server runs"
    for pid in servers:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert b"sk-worker-secret" not in environ and b"AGENTS_" not in environ, "the server holds no worker variable"
