"""agents-exe style executables brought as a toolbox folder: `describe` at load, `run` per call."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from celery_agents.errors import InvalidAgentFile
from celery_agents.model import AgentSpec
from celery_agents.tools import Sandbox, SandboxConfig, ToolRunner
from celery_agents.tools.resolve import load_agent_file
from tests.tools.conftest import PY, run_tool, write_program
from tests.tools.sample_tools import PNG_1PX

GREET = f"""#!{PY}
import json, os, sys
if sys.argv[1] == "describe":
    print(json.dumps({{"slug": "greet", "description": "Greets someone",
        "args": [{{"name": "name", "description": "who", "type": "string", "backing_type": "string",
                   "arity": "single", "mode": "dashdashspace"}},
                 {{"name": "times", "description": "how often", "type": "number", "backing_type": "int",
                   "arity": "optional", "mode": "dashdashequal"}},
                 {{"name": "tone", "description": "", "type": "string", "backing_type": "string",
                   "arity": "optional", "mode": "positional"}},
                 {{"name": "note", "description": "", "type": "string", "backing_type": "string",
                   "arity": "optional", "mode": "stdin"}}]}}))
    sys.exit(0)
print(json.dumps({{"argv": sys.argv[1:], "stdin": sys.stdin.read(), "session": os.environ.get("AGENT_SESSION_ID")}}))
"""

SCHEMA_TOOL = f"""#!{PY}
import json, sys
if sys.argv[1] == "describe":
    print(json.dumps({{"slug": "sum", "description": "Adds numbers",
        "parameters": {{"type": "object", "properties": {{"xs": {{"type": "array", "items": {{"type": "number"}}}}}},
                        "required": ["xs"]}}}}))
    sys.exit(0)
print(sum(json.load(sys.stdin)["xs"]))
"""

QUIET = f"""#!{PY}
import json, sys
if sys.argv[1] == "describe":
    print(json.dumps({{"slug": "quiet", "description": "Says nothing", "args": [],
                       "empty-result": {{"tag": "AddMessage", "contents": "No results"}}}}))
"""

CHART = f"""#!{PY}
import base64, json, sys
if sys.argv[1] == "describe":
    print(json.dumps({{"slug": "chart", "description": "Draws", "args": [], "output-media-type": "image/png"}}))
    sys.exit(0)
sys.stdout.buffer.write(base64.b64decode({PNG_1PX!r}))
"""


@pytest.fixture
def toolbox(tooldir: Path) -> Path:
    tools = tooldir / "tools"
    tools.mkdir()
    tools.chmod(0o755)
    write_program(tools, "greet", GREET, executable=True)
    write_program(tools, "sum", SCHEMA_TOOL, executable=True)
    write_program(tools, "quiet", QUIET, executable=True)
    write_program(tools, "chart", CHART, executable=True)
    (tools / "README.md").write_text("not a tool: not executable")
    return tooldir


def agent_file(folder: Path, **extra: Any) -> Path:
    path = folder / "agent.json"
    path.write_text(json.dumps({"slug": "box", "model": "openai/none", **extra}))
    return path


def test_a_toolbox_folder_becomes_tools_named_by_their_slugs(toolbox: Path) -> None:
    agent = load_agent_file(
        agent_file(
            toolbox,
            toolboxes=["tools/"],
            toolCallPolicy={"default": "runSync", "rules": [{"tool": "bash_greet", "disposition": "runAsync"}]},
        )
    )
    assert sorted(t.name for t in agent.tools) == ["bash_chart", "bash_greet", "bash_quiet", "bash_sum"]
    greet = agent.tool("bash_greet")
    assert greet is not None and greet.kind == "script" and greet.description == "Greets someone"
    assert greet.parameters == {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "description": "who"},
            "times": {"type": "number", "description": "how often"},
            "tone": {"type": "string"},
            "note": {"type": "string"},
        },
    }
    assert agent.tool("bash_sum").parameters["required"] == ["xs"]  # type: ignore[union-attr]


def test_run_passes_each_argument_as_its_mode_says(toolbox: Path) -> None:
    agent = load_agent_file(agent_file(toolbox, toolboxes=["tools"]))
    out = run_tool(
        ToolRunner(),
        agent,
        "bash_greet",
        {"name": "Ada", "times": 2, "tone": "warm", "note": "hi there"},
        session_id="s-greet",
    )
    assert out.state == "completed", out.error
    assert out.result == {
        "argv": ["run", "--name", "Ada", "--times=2", "warm"],
        "stdin": "hi there\n",
        "session": "s-greet",
    }


def test_a_value_that_would_add_a_line_or_an_option_is_refused_and_the_tool_does_not_run(toolbox: Path) -> None:
    agent = load_agent_file(agent_file(toolbox, toolboxes=["tools"]))
    runner = ToolRunner()
    line = run_tool(runner, agent, "bash_greet", {"name": "Ada", "note": "hi\nrm -rf /"})
    assert line.state == "failed" and "'note' goes to the tool as one line" in line.error
    option = run_tool(runner, agent, "bash_greet", {"name": "Ada", "tone": "--evil"})
    assert option.state == "failed" and "'tone' starts with '-'" in option.error
    spaced = run_tool(runner, agent, "bash_greet", {"name": "--times=99"})
    assert spaced.state == "failed" and "'name' starts with '-'" in spaced.error
    assert runner.executions == 3 and not line.exit_status and not option.exit_status, "refused before running"
    equal = run_tool(runner, agent, "bash_greet", {"name": "Ada", "times": -2})
    assert equal.state == "completed" and "--times=-2" in equal.result["argv"], "--name=VALUE may start with '-'"


def test_a_json_schema_description_gets_the_arguments_as_json_on_stdin(toolbox: Path) -> None:
    agent = load_agent_file(agent_file(toolbox, toolboxes=[{"path": "tools", "prefix": ""}]))
    assert run_tool(ToolRunner(), agent, "sum", {"xs": [1, 2, 3.5]}).result == 6.5
    bad = run_tool(ToolRunner(), agent, "sum", {"xs": "1,2"})
    assert bad.state == "failed" and "xs: '1,2' is not of type 'array'" in bad.error


def test_empty_output_answers_the_declared_message_and_media_output_is_attached(toolbox: Path) -> None:
    agent = load_agent_file(agent_file(toolbox, toolboxes=["tools"]))
    assert run_tool(ToolRunner(), agent, "bash_quiet").result == "No results"
    out = run_tool(ToolRunner(), agent, "bash_chart")
    assert out.state == "completed" and [m.mime_type for m in out.media] == ["image/png"]
    assert base64.b64decode(out.media[0].data_base64) == base64.b64decode(PNG_1PX)


def test_agents_exe_field_names_are_accepted(toolbox: Path) -> None:
    agent = load_agent_file(
        agent_file(
            toolbox,
            bashToolboxes=[
                {"tag": "FileSystemDirectory", "contents": {"path": "./tools", "basenameFilter": "gree"}},
                {"tag": "SingleTool", "contents": "./tools/sum"},
            ],
        )
    )
    assert sorted(t.name for t in agent.tools) == ["bash_greet", "bash_sum"]
    legacy = load_agent_file(agent_file(toolbox, toolDirectory="tools"))
    assert len(legacy.tools) == 4


def test_the_stored_agent_needs_no_describe_again(toolbox: Path) -> None:
    agent = load_agent_file(agent_file(toolbox, toolboxes=["tools"]))
    stored = agent.to_json()
    for exe in (toolbox / "tools").iterdir():
        if exe.name != "sum":
            exe.unlink()
    again = AgentSpec.from_json(stored)
    assert sorted(t.name for t in again.tools) == sorted(t.name for t in agent.tools)
    assert run_tool(ToolRunner(), again, "bash_sum", {"xs": [1]}).result == 1


def test_an_executable_that_does_not_describe_itself_refuses_the_file(toolbox: Path) -> None:
    write_program(
        toolbox / "tools", "broken", f"#!{PY}\nimport sys\nsys.stderr.write('no idea')\nsys.exit(2)\n", executable=True
    )
    with pytest.raises(InvalidAgentFile) as info:
        load_agent_file(agent_file(toolbox, toolboxes=["tools"]))
    message = info.value.message
    assert "agent.json: toolboxes[0]:" in message and "broken describe` failed: no idea" in message
    assert "move it out of the toolbox folder" in message
    shutil.rmtree(toolbox / "tools")
    with pytest.raises(InvalidAgentFile, match="no such folder or file"):
        load_agent_file(agent_file(toolbox, toolboxes=["tools"]))


def test_script_tools_run_in_the_sandbox_too(toolbox: Path) -> None:
    agent = load_agent_file(agent_file(toolbox, toolboxes=["tools"]))
    runner = ToolRunner(isolated=True, sandbox=Sandbox(SandboxConfig(bwrap="off")))
    out = run_tool(runner, agent, "bash_greet", {"name": "Bo"})
    assert out.state == "completed", out.error
    assert out.result["argv"] == ["run", "--name", "Bo"] and out.meta.isolation == "namespaces"
