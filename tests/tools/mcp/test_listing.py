"""An agent file's `mcpServers`: their tools are listed when the file is loaded and stored with the
spec (names, descriptions, input schemas as the servers give them); prefix rules in the policy; a
hostile server's listing (thousands of tools, megabytes of description or schema, pages without
end) is refused at load, naming the server, the tool and the bound."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from celery_agents.errors import InvalidAgentFile
from celery_agents.model import AgentSpec
from celery_agents.model.mcp import mcp_tool_name
from celery_agents.model.policy import disposition_for
from celery_agents.tools.resolve import load_agent_file, parse_agent
from tests.cli.process import agents, cli_env
from tests.tools.mcp.conftest import SAMPLE, TIME_SERVER, mcp_agent, sample_stdio


def test_tools_of_stdio_servers_are_listed_into_the_agent_with_the_servers_schemas() -> None:
    agent = mcp_agent([sample_stdio(), {"name": "time", "command": TIME_SERVER}])
    names = [t.name for t in agent.tools]
    assert {"mcp__sample__add", "mcp__sample__sleep", "mcp__sample__image", "mcp__time__get_current_time"} <= set(names)
    add = agent.tool("mcp__sample__add")
    assert add is not None and add.kind == "mcp" and add.mcp is not None
    assert (add.mcp.server, add.mcp.tool, add.description) == ("sample", "add", "Adds two whole numbers.")
    assert add.parameters["required"] == ["a", "b"] and add.parameters["properties"]["a"]["type"] == "integer"
    schema = next(t for t in agent.tools if t.name == "mcp__time__get_current_time").openai_schema()
    assert "timezone" in schema["function"]["parameters"]["properties"], "the model sees the server's schema"


def test_the_stored_spec_carries_the_tools_and_loading_it_lists_nothing(tmp_path: object) -> None:
    agent = mcp_agent([sample_stdio()])
    # A worker reads the stored JSON: the tools are in it, whatever the server does now.
    broken = agent.to_json().replace(str(SAMPLE), "/nonexistent/server.py")
    stored = AgentSpec.from_json(broken)
    assert [t.name for t in stored.tools] == [t.name for t in agent.tools]
    assert stored.mcp_server("sample") is not None


def test_the_claude_desktop_form_of_mcp_servers_is_accepted() -> None:
    data = {
        "slug": "desk",
        "model": "openai/none",
        "mcpServers": {"sample": {"command": sys.executable, "args": [str(SAMPLE)], "env": {"MARKER": "x"}}},
    }
    agent = parse_agent(data, "desk.json")
    server = agent.mcp_server("sample")
    assert server is not None and server.command == [sys.executable, str(SAMPLE)] and server.env == {"MARKER": "x"}
    assert agent.tool("mcp__sample__whoami") is not None


def test_a_server_that_cannot_start_makes_the_file_invalid_naming_the_server() -> None:
    with pytest.raises(InvalidAgentFile) as caught:
        mcp_agent([{"name": "broken", "command": [sys.executable, "-c", "import sys; sys.exit(3)"]}])
    assert "mcpServers[0] (broken): cannot list its tools" in caught.value.message


@pytest.mark.parametrize(
    ("server", "says"),
    [
        ({"name": "x"}, "exactly one of command (stdio) or url"),
        ({"name": "x", "command": ["a"], "url": "http://h/mcp"}, "exactly one of command (stdio) or url"),
        ({"name": "bad name", "command": ["a"]}, "a server name is"),
        ({"name": "x", "url": "ftp://h"}, "http:// or https://"),
        ({"name": "x", "url": "http://h/mcp", "headersEnv": {"Authorization": "not a name"}}, "headersEnv maps"),
    ],
)
def test_a_bad_server_entry_is_refused_before_anything_starts(server: dict[str, object], says: str) -> None:
    with pytest.raises(InvalidAgentFile) as caught:
        mcp_agent([server])
    assert "mcpServers[0]" in caught.value.message and says in caught.value.message


def test_an_exact_rule_beats_a_prefix_rule_whatever_their_order() -> None:
    agent = mcp_agent(
        [sample_stdio()],
        rules=[
            {"tool": "mcp__sample__*", "disposition": "runAsync"},
            {"tool": "mcp__sample__fail", "disposition": {"tag": "defer", "reason": "approve failures"}},
        ],
        executionMode="asynchronous",
    )
    assert disposition_for(agent, "mcp__sample__add").tag == "runAsync"
    assert disposition_for(agent, "mcp__sample__fail").tag == "defer"


def test_a_prefix_rule_matching_no_tool_is_refused() -> None:
    with pytest.raises(InvalidAgentFile) as caught:
        mcp_agent([sample_stdio()], rules=[{"tool": "mcp__other__*", "disposition": "runAsync"}])
    assert "matches no tool 'mcp__other__*'" in caught.value.message


def test_tool_names_the_providers_refuse_are_made_safe_without_colliding() -> None:
    assert mcp_tool_name("files", "read") == "mcp__files__read"
    odd = mcp_tool_name("files", "read.file/v2")
    long_a, long_b = mcp_tool_name("files", "x" * 70), mcp_tool_name("files", "x" * 71)
    for name in (odd, long_a, long_b):
        assert len(name) <= 64 and all(c.isalnum() or c in "_-" for c in name)
    assert long_a != long_b and odd.startswith("mcp__files__read_file_v2")


def test_a_misspelled_server_field_is_refused_with_the_closest_name() -> None:
    with pytest.raises(InvalidAgentFile) as caught:
        mcp_agent([{"name": "web", "url": "http://127.0.0.1:9/mcp", "headerEnv": {"Authorization": "T"}}])
    assert "mcpServers[0].headerEnv: unknown field (did you mean headersEnv?)" in caught.value.message


def test_a_server_that_cannot_start_says_why_in_the_refusal() -> None:
    command = [sys.executable, "-c", "import sys; sys.stderr.write('no config at /etc/x.toml\\n'); sys.exit(3)"]
    with pytest.raises(InvalidAgentFile) as caught:
        mcp_agent([{"name": "broken", "command": command}])
    assert "no config at /etc/x.toml" in caught.value.message


def hostile_agent(folder: Path, **knobs: int) -> Path:
    """An agent file whose MCP server `hostile` (the sample server) lists what `knobs` ask for."""
    server = sample_stdio("hostile", env={f"SAMPLE_{k.upper()}": str(v) for k, v in knobs.items()})
    path = folder / "hostile-agent.json"
    path.write_text(json.dumps({"slug": "hostile", "model": "openai/none", "mcpServers": [server]}))
    return path


def refusal(path: Path) -> str:
    with pytest.raises(InvalidAgentFile) as caught:
        load_agent_file(path)
    message = caught.value.message
    assert message.startswith(f"{path}: mcpServers[0] (hostile): ") and len(message) < 1000, message[:2000]
    return message


def test_a_server_listing_thousands_of_tools_is_refused_at_load_naming_the_bound(tmp_path: Path) -> None:
    message = refusal(hostile_agent(tmp_path, extra_tools=3004))
    assert "more than 256 tools" in message and "AGENTS_MCP_MAX_TOOLS" in message, message


def test_a_listing_whose_pages_never_end_is_refused_at_the_tool_bound_without_waiting(tmp_path: Path) -> None:
    started = time.monotonic()
    message = refusal(hostile_agent(tmp_path, endless_pages=1))
    assert "more than 256 tools" in message, message
    assert time.monotonic() - started < 30, "the listing stops at the bound, not at its timeout"


def test_a_two_megabyte_description_is_refused_at_load_naming_the_tool_and_the_bound(tmp_path: Path) -> None:
    message = refusal(hostile_agent(tmp_path, description_bytes=2 * 1024 * 1024))
    assert "tool 'verbose'" in message and "2097152 bytes" in message, message
    assert "more than 4096" in message and "AGENTS_MCP_MAX_DESCRIPTION_BYTES" in message, message


def test_a_description_at_the_bound_is_kept_whole(tmp_path: Path) -> None:
    agent = load_agent_file(hostile_agent(tmp_path, description_bytes=4096))
    verbose = agent.tool("mcp__hostile__verbose")
    assert verbose is not None and verbose.description == "d" * 4096


def test_a_huge_input_schema_is_refused_naming_the_tool_and_the_bound(tmp_path: Path) -> None:
    message = refusal(hostile_agent(tmp_path, schema_bytes=70_000))
    assert "tool 'wide'" in message and "input schema" in message, message
    assert "more than 65536" in message and "AGENTS_MCP_MAX_SCHEMA_BYTES" in message, message


def test_a_tool_name_longer_than_mcp_allows_is_refused_without_quoting_it_whole(tmp_path: Path) -> None:
    message = refusal(hostile_agent(tmp_path, name_length=5000))
    assert "a name of 5000 characters, more than 128" in message, message


def test_the_bounds_are_settings_of_the_loading_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = hostile_agent(tmp_path)
    assert load_agent_file(path).tool("mcp__hostile__add") is not None
    monkeypatch.setenv("AGENTS_MCP_MAX_LISTING_BYTES", "500")
    message = refusal(path)
    assert "its tools' descriptions and input schemas come to" in message, message
    assert "more than 500 bytes (AGENTS_MCP_MAX_LISTING_BYTES)" in message, message
    monkeypatch.delenv("AGENTS_MCP_MAX_LISTING_BYTES")
    monkeypatch.setenv("AGENTS_MCP_MAX_TOOLS", "3")
    assert "more than 3 tools" in refusal(path)
    monkeypatch.setenv("AGENTS_MCP_MAX_TOOLS", "400")
    agent = load_agent_file(hostile_agent(tmp_path, extra_tools=300))
    assert len([t for t in agent.tools if t.name.startswith("mcp__hostile__extra_")]) == 300


def test_a_refused_listing_makes_the_cli_exit_2_with_invalid_agent_file(tmp_path: Path) -> None:
    path = hostile_agent(tmp_path, description_bytes=2 * 1024 * 1024)
    run = agents(
        "session", "start", "--agent-file", path, "-p", "hi", "--json", env=cli_env(None, "mcpbounds", tmp_path)
    )
    assert run.returncode == 2, run
    error = run.doc["error"]
    assert error["code"] == "invalid_agent_file" and "AGENTS_MCP_MAX_DESCRIPTION_BYTES" in error["message"], error
