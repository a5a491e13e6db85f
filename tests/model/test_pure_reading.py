"""Reading an agent file runs nothing; resolving it is the separate step that does.

Each thing a file leaves to be found (a toolbox's `describe`, a python tool's module, an MCP
server) leaves a marker file when it runs: reading leaves none, resolving leaves all three."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from celery_agents.errors import InvalidAgentFile
from celery_agents.model import read_agent_file
from celery_agents.tools.resolve import resolve_agent

SAMPLE_SERVER = Path(__file__).parent.parent / "tools" / "mcp" / "sample_server.py"


def marked_agent(folder: Path, **extra: object) -> Path:
    """An agent whose toolbox, python tool and MCP server each leave a marker when they run."""
    tools = folder / "tools"
    tools.mkdir()
    describe = tools / "greet"
    describe.write_text(
        f"#!{sys.executable}\nimport json, pathlib, sys\n"
        f"pathlib.Path({str(folder / 'described')!r}).touch()\n"
        'print(json.dumps({"slug": "greet", "description": "Greets", "args": []}))\n'
    )
    describe.chmod(0o755)
    (folder / "marked_tool.py").write_text(
        f"import pathlib\npathlib.Path({str(folder / 'imported')!r}).touch()\n\n"
        'def shout(text: str) -> str:\n    """Shouts."""\n    return text.upper()\n'
    )
    (folder / "server.py").write_text(
        f"import pathlib, runpy\npathlib.Path({str(folder / 'started')!r}).touch()\n"
        f"runpy.run_path({str(SAMPLE_SERVER)!r}, run_name='__main__')\n"
    )
    agent = {
        "slug": "marked",
        "model": "openai/none",
        "tools": [{"name": "shout", "python": "marked_tool:shout"}],
        "toolboxes": ["tools"],
        "mcpServers": [{"name": "sample", "command": [sys.executable, "server.py"]}],
        **extra,
    }
    path = folder / "agent.json"
    path.write_text(json.dumps(agent))
    return path


def markers(folder: Path) -> list[str]:
    return sorted(m for m in ("described", "imported", "started") if (folder / m).exists())


def test_reading_an_agent_file_describes_imports_and_starts_nothing(tmp_path: Path) -> None:
    read = read_agent_file(marked_agent(tmp_path))
    assert markers(tmp_path) == []
    assert read.unresolved
    assert [t.name for t in read.declared.tools] == ["shout"]
    assert read.declared.tools[0].parameters == {"type": "object", "properties": {}}


def test_resolving_describes_the_toolbox_reads_the_signature_and_lists_the_server(tmp_path: Path) -> None:
    spec = resolve_agent(read_agent_file(marked_agent(tmp_path)))
    assert markers(tmp_path) == ["described", "imported", "started"]
    names = [t.name for t in spec.tools]
    assert names[:2] == ["shout", "bash_greet"]
    assert "mcp__sample__add" in names
    shout = spec.tool("shout")
    assert shout is not None and shout.description == "Shouts."
    assert shout.parameters["properties"] == {"text": {"type": "string"}}


def test_a_rule_may_name_a_tool_still_to_be_listed_and_resolving_checks_it(tmp_path: Path) -> None:
    rules = [{"tool": "mcp__sample__add", "disposition": "runAsync"}, {"tool": "bash_nothing", "disposition": "defer"}]
    read = read_agent_file(marked_agent(tmp_path, toolCallPolicy={"rules": rules}))
    assert markers(tmp_path) == []
    with pytest.raises(InvalidAgentFile, match="rules\\[1\\] names a tool 'bash_nothing'"):
        resolve_agent(read)


def test_a_file_with_nothing_to_resolve_is_its_declared_spec(tmp_path: Path) -> None:
    path = tmp_path / "plain.json"
    path.write_text(
        json.dumps({"slug": "plain", "model": "openai/none", "tools": [{"name": "x", "command": ["true"]}]})
    )
    read = read_agent_file(path)
    assert not read.unresolved
    assert resolve_agent(read) is read.declared
