"""The disposition's decorators: retries with backoff (only when the tool says so, or on a
timeout), truncate, and limits merged from defaults, tool and disposition."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from celery_agents.errors import InvalidAgentFile
from celery_agents.model import CallMeta, CallOutcome
from celery_agents.model.agent import Disposition, Limits, ToolSpec
from celery_agents.tools import ToolRunner
from celery_agents.tools.decorators import resolve_limits, with_retries
from celery_agents.tools.resolve import parse_agent
from celery_agents.tools.sandbox import DEFAULT_LIMITS
from tests.tools.conftest import PY, make_agent, run_tool, write_program

COUNTED = """
import os, sys, time
counter, fail_with, failures, hang_first = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "hang"
n = int(open(counter).read()) + 1 if os.path.exists(counter) else 1
open(counter, "w").write(str(n))
if n <= failures:
    if hang_first:
        time.sleep(600)
    sys.stderr.write(f"attempt {n} failed")
    sys.exit(fail_with)
print(f"attempt {n} worked")
"""


def counted_agent(
    tooldir: Path, fail_with: int, failures: int, disposition: dict[str, Any], hang: bool = False
) -> tuple[Any, Path]:
    write_program(tooldir, "counted.py", COUNTED)
    counter = tooldir / "count"
    agent = make_agent(
        [
            {
                "name": "counted",
                "command": [
                    PY,
                    str(tooldir / "counted.py"),
                    str(counter),
                    str(fail_with),
                    str(failures),
                    "hang" if hang else "-",
                ],
            }
        ],
        rules=[{"tool": "counted", "disposition": {"tag": "runSync", **disposition}}],
        executionMode="synchronous",
    )
    return agent, counter


def test_a_tool_exiting_75_is_retried_until_it_works(tooldir: Path) -> None:
    agent, counter = counted_agent(tooldir, 75, 2, {"retries": 3, "backoffSeconds": 0.01})
    out = run_tool(ToolRunner(), agent, "counted")
    assert (out.state, out.result, out.attempts) == ("completed", "attempt 3 worked", 3)
    assert out.meta.earlier_attempts == ["attempt 1 failed", "attempt 2 failed"]
    assert counter.read_text() == "3"


def test_retries_stop_when_spent_and_report_every_attempt(tooldir: Path) -> None:
    agent, counter = counted_agent(tooldir, 75, 10, {"retries": 2, "backoffSeconds": 0.01})
    out = run_tool(ToolRunner(), agent, "counted")
    assert (out.state, out.attempts, out.exit_status, out.error) == ("failed", 3, 75, "attempt 3 failed")
    assert counter.read_text() == "3"


def test_a_failure_the_tool_does_not_mark_retryable_is_not_retried(tooldir: Path) -> None:
    agent, counter = counted_agent(tooldir, 1, 1, {"retries": 5, "backoffSeconds": 0.01})
    out = run_tool(ToolRunner(), agent, "counted")
    assert (out.state, out.attempts, out.error) == ("failed", 1, "attempt 1 failed")
    assert counter.read_text() == "1"


def test_a_timeout_is_retried(tooldir: Path) -> None:
    agent, counter = counted_agent(
        tooldir, 1, 1, {"retries": 1, "timeoutSeconds": 1, "backoffSeconds": 0.01}, hang=True
    )
    assert not counter.exists()
    out = run_tool(ToolRunner(), agent, "counted")
    assert (out.state, out.result, out.attempts) == ("completed", "attempt 2 worked", 2)
    assert "did not finish within 1 s" in out.meta.earlier_attempts[0]


def test_backoff_doubles_from_the_base_and_is_capped() -> None:
    delays: list[float] = []

    def always_retryable() -> CallOutcome:
        return CallOutcome(state="failed", error="busy", meta=CallMeta(retryable=True))

    out = with_retries(always_retryable, Disposition(tag="runSync", retries=4), sleep=delays.append)
    assert out.attempts == 5 and delays == [0.5, 1.0, 2.0, 4.0]
    delays.clear()
    with_retries(always_retryable, Disposition(tag="runSync", retries=3, backoffSeconds=20), sleep=delays.append)
    assert delays == [20.0, 30.0, 30.0]


def test_truncate_cuts_the_result_and_says_so(tooldir: Path) -> None:
    agent = make_agent(
        [
            {"name": "long", "command": [PY, "-c", "print('é' * 400)"]},
            {"name": "json", "command": [PY, "-c", "import json; print(json.dumps({'k': 'v' * 300}))"]},
        ],
        rules=[
            {"tool": "long", "disposition": {"tag": "runSync", "truncate": 101}},
            {"tool": "json", "disposition": {"tag": "runSync", "truncate": 50}},
        ],
        executionMode="synchronous",
    )
    out = run_tool(ToolRunner(), agent, "long")
    kept, note = out.result.split("\n")
    assert kept == "é" * 50, "cut at a character boundary within 101 bytes"
    assert note == "[truncated: the result was 800 bytes, cut to 101]"
    assert out.meta.truncated == {"bytes": 800, "limit": 101}
    out = run_tool(ToolRunner(), agent, "json")
    assert out.result.startswith('{"k": "vvv') and "cut to 50" in out.result


def test_limits_come_from_defaults_then_the_tool_then_the_disposition() -> None:
    tool = ToolSpec(name="t", command=["x"], limits=Limits(memory_mb=100, processes=4))
    disp = Disposition(tag="runIsolated", limits=Limits(memory_mb=300))
    merged = resolve_limits(tool, disp, DEFAULT_LIMITS)
    assert (merged.memory_mb, merged.processes, merged.cpu_seconds) == (300, 4, DEFAULT_LIMITS.cpu_seconds)


def test_a_misspelt_limit_refuses_the_file() -> None:
    with pytest.raises(InvalidAgentFile) as info:
        parse_agent(
            {"slug": "x", "model": "m", "tools": [{"name": "t", "command": ["x"], "limits": {"memoryMB": 5}}]},
            "agent.json",
        )
    assert "agent.json: tools[0].limits.memoryMB: unknown field (did you mean memoryMb?)" in info.value.message


def test_worker_settings_are_never_given_to_a_tool() -> None:
    with pytest.raises(InvalidAgentFile) as info:
        parse_agent(
            {
                "slug": "x",
                "model": "m",
                "tools": [{"name": "t", "command": ["x"], "env": ["WEATHER_KEY", "AGENTS_REDIS_URL"]}],
            },
            "agent.json",
        )
    assert "tools[0].env: AGENTS_REDIS_URL is a setting of the worker, never given to a tool" in info.value.message
