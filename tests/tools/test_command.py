"""Command tools on real processes: arguments on stdin, the answer on stdout, every way to fail."""

from __future__ import annotations

import json
import signal
import time
import uuid
from pathlib import Path

import pytest

from celery_agents.tools import ToolRunner
from tests.tools.conftest import PY, alive_with, make_agent, run_tool, write_program
from tests.tools.sample_tools import PNG_1PX

ECHO = """
import json, os, sys
args = json.load(sys.stdin)
print(json.dumps({"args": args, "cwd": os.getcwd(),
                  "env": {k: v for k, v in os.environ.items() if k.startswith("AGENTS_")}}))
"""


def test_arguments_arrive_on_stdin_and_a_json_answer_is_the_result(tooldir: Path) -> None:
    (tooldir / "tools").mkdir()
    write_program(tooldir / "tools", "echo.py", ECHO)
    agent = make_agent(
        [
            {
                "name": "echo",
                "command": [PY, "tools/echo.py"],
                "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
            }
        ],
        base_dir=str(tooldir),
    )
    out = run_tool(ToolRunner(), agent, "echo", {"x": 7}, session_id="s-1", call_id="call_a")
    assert out.state == "completed", out.error
    assert out.result["args"] == {"x": 7}
    assert out.result["cwd"] == str(tooldir), "a command runs in the agent file's folder"
    env = out.result["env"]
    assert (env["AGENTS_SESSION_ID"], env["AGENTS_CALL_ID"], env["AGENTS_IDEMPOTENCY_KEY"]) == (
        "s-1",
        "call_a",
        "s-1:0:call_a",
    )
    assert (out.exit_status, out.attempts) == (0, 1) and out.duration_ms and out.duration_ms > 0


def test_text_output_is_the_stripped_text(tooldir: Path) -> None:
    agent = make_agent([{"name": "say", "command": [PY, "-c", "print('  it is sunny  ')"]}])
    out = run_tool(ToolRunner(), agent, "say")
    assert (out.state, out.result) == ("completed", "it is sunny")


def test_a_non_zero_exit_fails_with_stderr_as_the_error(tooldir: Path) -> None:
    agent = make_agent(
        [
            {
                "name": "no",
                "command": [
                    PY,
                    "-c",
                    "import sys; print('partial'); sys.stderr.write('no such city: Atlantis'); sys.exit(3)",
                ],
            }
        ]
    )
    out = run_tool(ToolRunner(), agent, "no")
    assert (out.state, out.exit_status, out.error, out.attempts) == ("failed", 3, "no such city: Atlantis", 1)
    assert not out.meta.retryable


def test_arguments_that_do_not_match_the_schema_never_reach_the_tool(tooldir: Path) -> None:
    log = tooldir / "ran"
    agent = make_agent(
        [
            {
                "name": "weather",
                "command": [PY, "-c", f"open({str(log)!r}, 'w')"],
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                    "required": ["city"],
                },
            }
        ]
    )
    out = run_tool(ToolRunner(), agent, "weather", {"days": "three"})
    assert out.state == "failed" and out.attempts == 0 and out.meta.invalid_arguments
    assert "'city' is a required property" in out.error
    assert "days: 'three' is not of type 'integer'" in out.error
    assert "city (string, required), days (integer)" in out.error, "the model is told what to send"
    assert not log.exists()


def test_a_hung_tool_is_killed_at_its_timeout_with_a_child_that_ignores_sigterm(tooldir: Path) -> None:
    marker = f"hung-{uuid.uuid4().hex}"
    ready = tooldir / "child.pid"
    write_program(
        tooldir,
        "hang.py",
        f"""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c",
            "import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)", {str(ready)!r}, "{marker}"])
        while not os.path.exists({str(ready)!r}):
            time.sleep(0.01)
        time.sleep(600)
    """,
    )
    agent = make_agent(
        [{"name": "hang", "command": [PY, str(tooldir / "hang.py"), marker]}],
        rules=[{"tool": "hang", "disposition": {"tag": "runSync", "timeoutSeconds": 2}}],
        executionMode="synchronous",
    )
    started = time.monotonic()
    out = run_tool(ToolRunner(), agent, "hang")
    elapsed = time.monotonic() - started
    assert out.state == "failed" and out.meta.timed_out
    assert "did not finish within 2 s and was killed" in out.error
    assert ready.exists(), "the child had started and was ignoring SIGTERM"
    child = int(ready.read_text())
    assert alive_with(marker) == [] and child not in alive_with(marker)
    assert 2 <= elapsed < 2 + 1 + 3, "SIGTERM at the timeout, SIGKILL one grace second later"


def test_oversize_output_is_cut_at_the_cap_and_says_so(tooldir: Path) -> None:
    agent = make_agent(
        [
            {
                "name": "flood",
                "command": [PY, "-c", "import sys; sys.stdout.write('y' * 5_000_000)"],
                "limits": {"outputBytes": 1000},
            }
        ]
    )
    out = run_tool(ToolRunner(), agent, "flood")
    assert out.state == "completed"
    assert out.result.startswith("y" * 1000)
    assert "the tool wrote 5000000 bytes; only the first 1000 are kept" in out.result
    assert out.meta.output_capped == {"written": 5_000_000, "cap": 1000}


def test_a_tool_killed_by_a_signal_fails_saying_which(tooldir: Path) -> None:
    suicide = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    agent = make_agent([{"name": "die", "command": [PY, "-c", suicide]}])
    out = run_tool(ToolRunner(), agent, "die")
    assert (out.state, out.exit_status) == ("failed", -signal.SIGKILL)
    assert "killed by SIGKILL" in out.error


def test_a_missing_program_fails_without_raising(tooldir: Path) -> None:
    agent = make_agent([{"name": "ghost", "command": ["/nonexistent/tool"]}])
    out = run_tool(ToolRunner(), agent, "ghost")
    assert out.state == "failed" and "cannot start '/nonexistent/tool'" in out.error


def test_children_left_behind_by_a_finished_tool_are_killed(tooldir: Path) -> None:
    marker = f"orphan-{uuid.uuid4().hex}"
    agent = make_agent(
        [
            {
                "name": "bg",
                "command": [
                    PY,
                    "-c",
                    (
                        "import subprocess, sys; "
                        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', sys.argv[1]], "
                        "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print('started')"
                    ),
                    marker,
                ],
            }
        ]
    )
    out = run_tool(ToolRunner(), agent, "bg")
    assert (out.state, out.result) == ("completed", "started")
    assert alive_with(marker) == []


def test_an_image_printed_on_stdout_becomes_media(tooldir: Path) -> None:
    image = {"type": "image", "mimeType": "image/png", "base64Data": PNG_1PX}
    agent = make_agent([{"name": "draw", "command": [PY, "-c", f"print({json.dumps(json.dumps(image))})"]}])
    out = run_tool(ToolRunner(), agent, "draw")
    assert out.state == "completed"
    assert [(m.mime_type, m.data_base64) for m in out.media] == [("image/png", PNG_1PX)]
    assert out.result.startswith("attached: image/png")


def test_a_command_tool_gets_only_the_variables_it_or_the_worker_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOOLTEST_NAMED", "named")
    monkeypatch.setenv("TOOLTEST_SHARED", "shared")
    monkeypatch.setenv("TOOLTEST_OTHER", "other")
    monkeypatch.setenv("AGENTS_SPEC_KEY", "never-a-tool-s")
    show = [
        PY,
        "-c",
        "import json, os; print(json.dumps(sorted(k for k in os.environ if k.startswith(('TOOLTEST', 'AGENTS')))))",
    ]
    agent = make_agent(
        [{"name": "env", "command": show, "env": ["TOOLTEST_NAMED"]}, {"name": "plain", "command": show}]
    )
    runner = ToolRunner(tool_env=("TOOLTEST_SHARED",))
    ids = ["AGENTS_CALL_ID", "AGENTS_IDEMPOTENCY_KEY", "AGENTS_SESSION_ID"]
    assert run_tool(runner, agent, "env").result == [*ids, "TOOLTEST_NAMED", "TOOLTEST_SHARED"]
    assert run_tool(runner, agent, "plain").result == [*ids, "TOOLTEST_SHARED"]
    assert run_tool(ToolRunner(), agent, "plain").result == ids
