"""The agent file as a user writes it: what is accepted, and how a bad file is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from celery_agents.errors import InvalidAgentFile
from celery_agents.model import AgentSpec, Disposition, agent_json_schema
from celery_agents.tools.resolve import load_agent_file, parse_agent

TOOLS: list[dict[str, Any]] = [
    {
        "name": "get_weather",
        "description": "weather",
        "command": ["python3", "tools/weather.py"],
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    {"name": "lookup", "python": "mypkg.tools:lookup", "parameters": {"type": "object", "properties": {}}},
    {"name": "approve_payment", "external": True},
]


def agent(**extra: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"slug": "weather", "model": "openai/gpt-4o-mini", "tools": TOOLS}
    data.update(extra)
    return data


@pytest.fixture
def write(tmp_path: Path) -> Any:
    def _write(content: dict[str, Any] | str) -> Path:
        path = tmp_path / "agent.json"
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        return path

    return _write


def refusal(path: Path) -> str:
    with pytest.raises(InvalidAgentFile) as info:
        load_agent_file(path)
    message = info.value.message
    assert str(path) in message, "the message names the file"
    assert info.value.code == "invalid_agent_file"
    assert info.value.exit_code == 2
    return message


# -- accepted files ----------------------------------------------------------------------------


def test_the_contract_example_loads_with_every_field(write: Any, tmp_path: Path) -> None:
    path = write(
        agent(
            apiBase="http://127.0.0.1:8000/v1",
            apiKeyEnv="OPENAI_API_KEY",
            systemPrompt="You are ...",
            maxSteps=40,
            executionMode="asynchronous",
            toolCallPolicy={
                "default": "runSync",
                "rules": [
                    {"tool": "get_weather", "disposition": {"tag": "defer", "reason": "approval required"}},
                    {"tool": "lookup", "disposition": {"tag": "runAsync"}},
                ],
            },
        )
    )
    spec = load_agent_file(path)
    assert spec.slug == "weather"
    assert spec.api_base == "http://127.0.0.1:8000/v1"
    assert spec.api_key_env == "OPENAI_API_KEY"
    assert spec.max_steps == 40
    assert [t.kind for t in spec.tools] == ["command", "python", "external"]
    assert spec.tool_call_policy is not None
    assert spec.tool_call_policy.rules[0].disposition == Disposition(tag="defer", reason="approval required")
    # relative command paths resolve against the agent file's folder
    assert spec.base_dir == str(tmp_path.resolve())


def test_optional_fields_have_defaults() -> None:
    spec = parse_agent({"slug": "a", "model": "m"})
    assert spec.tools == []
    assert spec.tool_call_policy is None
    assert spec.system_prompt_text is None
    assert spec.max_steps == 40
    assert spec.mode == "synchronous"


def test_system_prompt_as_list_of_lines_is_joined() -> None:
    spec = parse_agent({"slug": "a", "model": "m", "systemPrompt": ["line one", "line two"]})
    assert spec.system_prompt_text == "line one\nline two"


@pytest.mark.parametrize("written", ["runAsync", {"tag": "runAsync"}])
def test_disposition_written_as_string_or_object(written: Any) -> None:
    spec = parse_agent(
        agent(toolCallPolicy={"default": written, "rules": [{"tool": "lookup", "disposition": written}]})
    )
    assert spec.tool_call_policy is not None
    assert spec.tool_call_policy.default == Disposition(tag="runAsync")
    assert spec.tool_call_policy.rules[0].disposition == Disposition(tag="runAsync")


def test_disposition_object_keeps_reason_and_decorators() -> None:
    d = Disposition.model_validate(
        {"tag": "defer", "reason": "a human approves", "timeoutSeconds": 30, "retries": 2, "truncate": 100}
    )
    assert (d.tag, d.reason, d.timeout_seconds, d.retries, d.truncate) == (
        "defer",
        "a human approves",
        30,
        2,
        100,
    )


@pytest.mark.parametrize("spelling", ["toolCallPolicy", "toolCallPolicyConfig"])
def test_both_policy_spellings_mean_the_same(spelling: str) -> None:
    policy = {"default": "runAsync", "rules": [{"tool": "lookup", "disposition": {"tag": "defer"}}]}
    spec = parse_agent(agent(**{spelling: policy}))
    reference = parse_agent(agent(toolCallPolicy=policy))
    assert spec == reference
    assert spec.content_hash() == reference.content_hash()


def test_a_policy_without_execution_mode_means_asynchronous() -> None:
    assert parse_agent(agent(toolCallPolicy={"default": "runAsync"})).mode == "asynchronous"
    assert parse_agent(agent(toolCallPolicyConfig={"default": "runAsync"})).mode == "asynchronous"
    assert parse_agent(agent()).mode == "synchronous"


def test_an_explicit_execution_mode_wins_over_the_default() -> None:
    spec = parse_agent(agent(executionMode="synchronous", toolCallPolicy={"default": "runAsync"}))
    assert spec.mode == "synchronous"
    assert parse_agent(agent(executionMode="asynchronous")).mode == "asynchronous"


# -- refused files: file, field, fix -------------------------------------------------------------


def test_bad_json_names_line_and_column(write: Any) -> None:
    message = refusal(write('{\n  "slug": "x",\n  "model": \n}'))
    assert "line 4 column 1" in message
    assert "JSON" in message
    assert "fix the JSON syntax" in message


def test_a_missing_file_is_refused_with_its_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    message = refusal(missing)
    assert "no such file" in message


def test_an_agent_file_that_is_not_an_object_is_refused(write: Any) -> None:
    message = refusal(write("[1, 2]"))
    assert "JSON object" in message


@pytest.mark.parametrize("missing", ["slug", "model"])
def test_a_missing_field_is_named_with_the_fix(write: Any, missing: str) -> None:
    data = agent()
    del data[missing]
    message = refusal(write(data))
    assert f"{missing}: this field is required" in message
    assert "add it" in message


@pytest.mark.parametrize(
    "where,policy,field",
    [
        ("default string", {"default": "runLater"}, "toolCallPolicy.default.tag"),
        ("default object", {"default": {"tag": "runLater"}}, "toolCallPolicy.default.tag"),
        (
            "rule",
            {"rules": [{"tool": "lookup", "disposition": {"tag": "later"}}]},
            "toolCallPolicy.rules[0].disposition.tag",
        ),
    ],
)
def test_an_unknown_disposition_tag_is_named_with_the_allowed_tags(
    write: Any, where: str, policy: dict[str, Any], field: str
) -> None:
    message = refusal(write(agent(toolCallPolicy=policy)))
    assert field in message
    assert "use one of runSync, runAsync, runIsolated, defer" in message


def test_a_rule_naming_no_declared_tool_is_refused(write: Any) -> None:
    message = refusal(
        write(
            agent(
                toolCallPolicy={
                    "rules": [
                        {"tool": "lookup", "disposition": "runAsync"},
                        {"tool": "bash_command", "disposition": "defer"},
                    ]
                }
            )
        )
    )
    assert "toolCallPolicy.rules[1]" in message
    assert "'bash_command'" in message
    assert "get_weather, lookup, approve_payment" in message, "the message lists the declared tools"
    assert "fix the name or add the tool" in message


def test_errors_in_the_alias_spelling_name_the_field_as_written(write: Any) -> None:
    message = refusal(write(agent(toolCallPolicyConfig={"default": "runLater"})))
    assert "toolCallPolicyConfig.default" in message


def test_a_tool_with_two_kinds_is_refused(write: Any) -> None:
    message = refusal(write(agent(tools=[{"name": "t", "command": ["echo"], "python": "a.b:c", "parameters": {}}])))
    assert "tools[0]" in message
    assert "needs exactly one of command, python" in message
    assert "found command, python" in message


def test_a_tool_with_no_kind_is_refused(write: Any) -> None:
    message = refusal(write(agent(tools=[{"name": "t"}])))
    assert "tools[0]" in message
    assert "needs exactly one of command, python" in message
    assert "found none" in message


@pytest.mark.parametrize("name", ["bad name", "a/b", "", "x" * 65])
def test_a_bad_tool_name_is_refused_with_the_rule(write: Any, name: str) -> None:
    message = refusal(write(agent(tools=[{"name": name, "command": ["echo"]}])))
    assert "tools[0].name" in message
    assert "1-64 letters, digits, '_' or '-'" in message


def test_duplicate_tool_names_are_refused(write: Any) -> None:
    message = refusal(write(agent(tools=[{"name": "t", "command": ["a"]}, {"name": "t", "command": ["b"]}])))
    assert "unique" in message
    assert "repeated: t" in message


def test_both_policy_spellings_at_once_are_refused(write: Any) -> None:
    message = refusal(write(agent(toolCallPolicy={"default": "runSync"}, toolCallPolicyConfig={"default": "runSync"})))
    assert "give toolCallPolicy or toolCallPolicyConfig, not both" in message


def test_a_bad_execution_mode_names_the_allowed_values(write: Any) -> None:
    message = refusal(write(agent(executionMode="fast")))
    assert "executionMode" in message
    assert '"synchronous" or "asynchronous"' in message


@pytest.mark.parametrize(
    "bad,field,fix",
    [
        ({"maxSteps": 0}, "maxSteps", "give a larger number"),
        ({"maxSteps": "many"}, "maxSteps", "give a whole number"),
        ({"tools": [{"name": "t", "command": []}]}, "tools[0].command", "non-empty list"),
        (
            {"tools": [{"name": "t", "python": "no_colon", "parameters": {}}]},
            "tools[0].python",
            "package.module:function",
        ),
        ({"slug": "has space"}, "slug", "1-64 letters"),
        ({"model": "  "}, "model", "name the model"),
        ({"pricing": {"inputPerMTokUsd": -1, "outputPerMTokUsd": 1}}, "pricing.inputPerMTokUsd", "larger number"),
        ({"pricing": {"inputPerMTokUsd": 1}}, "pricing.outputPerMTokUsd", "add it"),
        ({"pricing": {"inputPerMTokUsd": 1, "outputPerMTokUsd": 1, "extra": 0}}, "pricing.extra", "unknown"),
        ({"pricing": {"inputPerMTokUsd": 1e9, "outputPerMTokUsd": 1}}, "pricing.inputPerMTokUsd", "smaller number"),
    ],
)
def test_other_bad_values_name_field_and_fix(write: Any, bad: dict[str, Any], field: str, fix: str) -> None:
    message = refusal(write(agent(**bad)))
    assert f"{field}:" in message
    assert fix in message


def test_every_problem_of_a_file_is_listed() -> None:
    with pytest.raises(InvalidAgentFile) as info:
        parse_agent({"tools": [{"name": "t"}]}, "f.json")
    lines = info.value.message.splitlines()
    assert any(line.startswith("f.json: slug:") for line in lines)
    assert any(line.startswith("f.json: model:") for line in lines)
    assert any(line.startswith("f.json: tools[0]") for line in lines)


# -- JSON round trips and the schema ---------------------------------------------------------------


def full_agent() -> AgentSpec:
    return parse_agent(
        agent(
            apiBase="http://h/v1",
            apiKeyEnv="K",
            systemPrompt=["a", "b"],
            maxSteps=3,
            executionMode="asynchronous",
            deferTimeoutSeconds=7,
            modelParams={"temperature": 0},
            toolCallPolicyConfig={
                "default": "runAsync",
                "rules": [
                    {
                        "tool": "get_weather",
                        "disposition": {
                            "tag": "defer",
                            "reason": "r",
                            "timeoutSeconds": 5,
                            "retries": 2,
                            "truncate": 10,
                        },
                    },
                    {"tool": "lookup", "disposition": "runIsolated"},
                ],
            },
        ),
        base_dir="/srv/agents",
    )


def test_agent_spec_round_trips_through_its_json() -> None:
    spec = full_agent()
    again = AgentSpec.from_json(spec.to_json())
    assert again == spec
    assert again.to_json() == spec.to_json()
    assert again.content_hash() == spec.content_hash()
    assert again.base_dir == "/srv/agents"


def test_content_hash_changes_with_the_content() -> None:
    spec = full_agent()
    other = AgentSpec.from_json(json.dumps({**json.loads(spec.to_json()), "maxSteps": 4}))
    assert other.content_hash() != spec.content_hash()


def test_stored_json_is_the_agent_file_spelling() -> None:
    data = json.loads(full_agent().to_json())
    assert "toolCallPolicy" in data and "toolCallPolicyConfig" not in data
    assert data["toolCallPolicy"]["rules"][1]["disposition"] == {"tag": "runIsolated"}
    assert data["apiKeyEnv"] == "K"


def test_json_schema_describes_the_file_fields() -> None:
    schema = agent_json_schema()
    props = schema["properties"]
    for name in (
        "slug",
        "model",
        "apiBase",
        "apiKeyEnv",
        "systemPrompt",
        "maxSteps",
        "tools",
        "executionMode",
        "toolCallPolicy",
    ):
        assert name in props
    assert set(schema["required"]) == {"slug", "model"}
    as_string, as_object = schema["$defs"]["Disposition"]["anyOf"]
    assert as_string["enum"] == ["runSync", "runAsync", "runIsolated", "defer"]
    assert as_object["properties"]["tag"]["enum"] == ["runSync", "runAsync", "runIsolated", "defer"]
    json.dumps(schema)  # it is plain JSON


def _validate(instance: dict[str, Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(instance, agent_json_schema())


def test_json_schema_accepts_the_contract_example_and_refuses_a_bad_tag() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    _validate(
        agent(
            toolCallPolicy={
                "default": {"tag": "runSync"},
                "rules": [{"tool": "lookup", "disposition": {"tag": "defer", "reason": "approval required"}}],
            }
        )
    )
    with pytest.raises(jsonschema.ValidationError):
        _validate(agent(toolCallPolicy={"default": {"tag": "runLater"}}))


def test_json_schema_accepts_a_disposition_written_as_a_string() -> None:
    _validate(agent(toolCallPolicy={"default": "runSync", "rules": [{"tool": "lookup", "disposition": "defer"}]}))
