"""An agent file's `mcpServers`: their tools are listed when the file is loaded and stored with the
spec (names, descriptions, input schemas as the servers give them); prefix rules in the policy."""

from __future__ import annotations

import sys

import pytest

from celery_agents.errors import InvalidAgentFile
from celery_agents.model import AgentSpec, parse_agent
from celery_agents.model.mcp import mcp_tool_name
from celery_agents.scheduler.policy import disposition_for
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
