"""The offline `test/tools` model: arguments valid under each tool's schema (checked with
jsonschema), deterministic; a sub-agent tree runs with it end to end, inline, on a real Redis, and
so do an MCP server's tools (the SDK-written sample server over stdio); a watched session's answer
streams in several deltas that join into the committed answer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.llm.tools_model import example_arguments, tools_reply
from celery_agents.model import State
from tests.tools.mcp.conftest import sample_stdio

SCHEMAS: dict[str, dict[str, Any]] = {
    "empty": {"type": "object"},
    "types": {
        "type": "object",
        "properties": {
            "s": {"type": "string"},
            "i": {"type": "integer"},
            "n": {"type": "number"},
            "b": {"type": "boolean"},
            "z": {"type": "null"},
        },
        "required": ["s", "i", "n", "b", "z"],
    },
    "bounds": {
        "type": "object",
        "properties": {
            "low": {"type": "integer", "minimum": 10},
            "high": {"type": "integer", "maximum": -3},
            "open": {"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 2},
            "step": {"type": "integer", "minimum": 7, "multipleOf": 5},
            "short": {"type": "string", "maxLength": 2},
            "long": {"type": "string", "minLength": 40},
        },
        "required": ["low", "high", "open", "step", "short", "long"],
    },
    "formats": {
        "type": "object",
        "properties": {f: {"type": "string", "format": f} for f in ("date", "date-time", "email", "uri", "uuid")},
        "required": ["date", "date-time", "email", "uri", "uuid"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "order": {
                "type": "object",
                "properties": {
                    "items": {
                        "type": "array",
                        "minItems": 3,
                        "uniqueItems": True,
                        "items": {"type": "string"},
                    },
                    "kind": {"enum": ["pickup", "delivery"]},
                    "rows": {
                        "type": "array",
                        "items": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
                    },
                },
                "required": ["items", "kind", "rows"],
                "additionalProperties": False,
            },
            "optional": {"type": "string"},
        },
        "required": ["order"],
    },
    "composed": {
        "type": "object",
        "$defs": {"city": {"type": "string", "minLength": 2}},
        "properties": {
            "city": {"$ref": "#/$defs/city"},
            "either": {"anyOf": [{"type": "integer", "minimum": 3}, {"type": "string"}]},
            "one": {"oneOf": [{"const": "a"}, {"const": "b"}]},
            "both": {"allOf": [{"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}]},
            "maybe": {"type": ["null", "string"]},
            "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}]},
            "said": {"type": "string", "examples": ["hello"]},
        },
        "required": ["city", "either", "one", "both", "maybe", "pair", "said"],
    },
    "defaults": {
        "type": "object",
        "properties": {"days": {"type": "integer", "default": 3}, "unit": {"type": "string", "default": "c"}},
    },
}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_the_arguments_validate_against_the_tool_schema(name: str) -> None:
    schema = SCHEMAS[name]
    args = example_arguments(schema)
    jsonschema.validate(args, schema, format_checker=jsonschema.FormatChecker())
    assert args == example_arguments(schema), "deterministic"


def test_defaults_and_enums_are_what_the_schema_names() -> None:
    assert example_arguments(SCHEMAS["defaults"]) == {"days": 3, "unit": "c"}
    assert example_arguments(SCHEMAS["nested"])["order"]["kind"] == "pickup"
    assert "optional" not in example_arguments(SCHEMAS["nested"]), "an optional property without a default is left out"


def test_every_offered_tool_is_called_once_then_the_results_are_the_answer() -> None:
    tools = [{"type": "function", "function": {"name": n, "parameters": SCHEMAS[n]}} for n in ("types", "nested")]
    first = tools_reply([{"role": "user", "content": "go"}], tools)
    assert [c["name"] for c in first["tool_calls"]] == ["types", "nested"]
    assert first["content"] is None
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "tool_calls": [{"id": c["id"], "function": {"name": c["name"]}} for c in first["tool_calls"]],
        },
        *({"role": "tool", "tool_call_id": c["id"], "content": f"result of {c['name']}"} for c in first["tool_calls"]),
    ]
    answer = tools_reply(messages, tools)
    assert answer["tool_calls"] == []
    assert answer["content"] == "I called 2 tools. types returned result of types. nested returned result of nested."


def test_a_sub_agent_tree_runs_offline(settings: Settings, tmp_path: Path) -> None:
    # its schema derived from the signature: forecast(city: str, days: int = 3, unit: Literal["C", "F"] = "C")
    tool = {"name": "forecast", "description": "a forecast", "python": "tests.tools.sample_tools:forecast"}
    (tmp_path / "child.json").write_text(json.dumps({"slug": "child", "model": "test/tools", "tools": [tool]}))
    parent = tmp_path / "parent.json"
    parent.write_text(json.dumps({"slug": "parent", "model": "test/tools", "subAgents": ["child.json"]}))
    with Client(settings, inline=True) as client:
        view = client.start(parent, "try everything", run=True)
        assert view.state == State.COMPLETED
        assert view.response is not None and view.response.startswith("I called 1 tool. prompt_agent_child returned")
        (child,) = view.children
        child_view = client.view(child)
        assert child_view.response is not None and "forecast returned" in child_view.response


def test_a_watched_answer_streams_in_several_deltas_that_join_into_the_answer(
    settings: Settings, tmp_path: Path
) -> None:
    tool = {"name": "forecast", "description": "a forecast", "python": "tests.tools.sample_tools:forecast"}
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"slug": "a", "model": "test/tools", "tools": [tool]}))
    seen: list[dict[str, Any]] = []
    with Client(settings, inline=True) as client:
        view = client.start(path, "go", run=True, watch=True, on_event=seen.append)
    assert view.state == State.COMPLETED and view.response
    # the last answer's text: the deltas after the tool ran (the first answer had only reasoning)
    texts = [e for e in seen if e["type"] == "text_delta"]
    assert len(texts) >= 3, f"the answer came as {len(texts)} deltas"
    assert "".join(e["text"] for e in texts) == view.response
    assert [e["offset"] for e in texts] == [sum(len(t["text"]) for t in texts[:i]) for i in range(len(texts))]
    reasoning = [e for e in seen if e["type"] == "reasoning_delta"]
    assert len(reasoning) >= 2 and "".join(e["text"] for e in reasoning).startswith("I call every tool")


def test_an_mcp_server_s_tools_are_called_with_valid_arguments_and_their_results_folded_in(
    settings: Settings, tmp_path: Path
) -> None:
    log = tmp_path / "calls.log"
    server = {"name": "sample", **sample_stdio(), "env": {"SAMPLE_TOOLS": "add,sleep", "CALL_LOG": str(log)}}
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"slug": "mcp-offline", "model": "test/tools", "mcpServers": [server]}))
    with Client(settings, inline=True) as client:
        spec = client.agent_spec(path)
        view = client.start(spec, "try the server", run=True)
        shown = client.show(view.session_id, detail=True)
    assert view.state == State.COMPLETED, view.error
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["add", "sleep"], "the server ran each"
    schemas = {t.name: t.parameters for t in spec.tools}
    called = {c["tool"]: c["arguments"] for c in shown.calls or []}
    assert sorted(called) == ["mcp__sample__add", "mcp__sample__sleep"]
    for tool, arguments in called.items():
        jsonschema.validate(arguments, schemas[tool])
    assert view.response == (
        'I called 2 tools. mcp__sample__add returned {"result": 2}. '
        'mcp__sample__sleep returned {"result": "slept 1 s"}.'
    ), "each result is folded into the answer"
