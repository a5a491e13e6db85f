"""Sub-agents in the agent file: loaded from paths relative to the file (`extraAgents` too),
offered as `prompt_agent_<slug>` tools, and refused at load when they recurse or nest too deep."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from celery_agents.errors import InvalidAgentFile
from celery_agents.model import AgentSpec
from celery_agents.model.policy import disposition_for
from celery_agents.tools.resolve import load_agent_file


def write(folder: Path, name: str, **data: Any) -> Path:
    path = folder / name
    path.write_text(json.dumps({"slug": name.removesuffix(".json"), "model": "fake/model", **data}))
    return path


def test_a_sub_agent_is_offered_as_a_prompt_tool_with_its_description(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub", "researcher.json", description="Looks things up.")
    spec = load_agent_file(write(tmp_path, "boss.json", subAgents=["sub/researcher.json"]))
    (schema,) = spec.tool_schemas()
    assert schema["function"]["name"] == "prompt_agent_researcher"
    assert schema["function"]["description"] == "Looks things up."
    assert schema["function"]["parameters"]["required"] == ["prompt"]
    assert spec.sub_agent("prompt_agent_researcher") is not None


def test_extra_agents_is_read_as_sub_agents(tmp_path: Path) -> None:
    write(tmp_path, "helper.json")
    spec = load_agent_file(write(tmp_path, "boss.json", extraAgents=["helper.json"]))
    assert [a.slug for a in spec.sub_agents or []] == ["helper"]


def test_the_stored_spec_carries_its_sub_agents_and_reads_back_the_same(tmp_path: Path) -> None:
    write(tmp_path, "helper.json", systemPrompt="help")
    spec = load_agent_file(write(tmp_path, "boss.json", subAgents=["helper.json"]))
    again = AgentSpec.from_json(spec.to_json())
    assert again.content_hash() == spec.content_hash()
    assert again.sub_agent("prompt_agent_helper") == spec.sub_agent("prompt_agent_helper")


def test_an_agent_without_sub_agents_keeps_its_content_hash() -> None:
    spec = AgentSpec.model_validate({"slug": "plain", "model": "fake/model"})
    assert "subAgents" not in spec.to_json() and "maxDepth" not in spec.to_json()


def test_an_agent_that_delegates_to_itself_through_another_is_refused(tmp_path: Path) -> None:
    write(tmp_path, "a.json", subAgents=["b.json"])
    write(tmp_path, "b.json", subAgents=["a.json"])
    with pytest.raises(InvalidAgentFile) as caught:
        load_agent_file(tmp_path / "a.json")
    assert "delegates to itself" in caught.value.message and caught.value.exit_code == 2


def test_nesting_deeper_than_max_depth_is_refused(tmp_path: Path) -> None:
    write(tmp_path, "c.json")
    write(tmp_path, "b.json", subAgents=["c.json"])
    write(tmp_path, "a.json", subAgents=["b.json"], maxDepth=1)
    with pytest.raises(InvalidAgentFile) as caught:
        load_agent_file(tmp_path / "a.json")
    assert "maxDepth (1)" in caught.value.message
    write(tmp_path, "a.json", subAgents=["b.json"], maxDepth=2)
    assert load_agent_file(tmp_path / "a.json").depth == 2


def test_the_default_depth_allows_four_levels_and_not_five(tmp_path: Path) -> None:
    write(tmp_path, "l5.json")
    for level in range(4, -1, -1):
        write(tmp_path, f"l{level}.json", subAgents=[f"l{level + 1}.json"])
    with pytest.raises(InvalidAgentFile):
        load_agent_file(tmp_path / "l0.json")
    assert load_agent_file(tmp_path / "l1.json").depth == 4


def test_a_missing_sub_agent_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(InvalidAgentFile) as caught:
        load_agent_file(write(tmp_path, "boss.json", subAgents=["nowhere.json"]))
    assert "nowhere.json" in caught.value.message


def test_a_delegation_runs_as_a_child_unless_a_rule_defers_it(tmp_path: Path) -> None:
    write(tmp_path, "helper.json")
    rule = {"tool": "prompt_agent_helper", "disposition": {"tag": "defer", "reason": "approve first"}}
    plain = load_agent_file(write(tmp_path, "boss.json", subAgents=["helper.json"]))
    deferred = load_agent_file(
        write(tmp_path, "boss2.json", subAgents=["helper.json"], toolCallPolicy={"default": "runSync", "rules": [rule]})
    )
    assert disposition_for(plain, "prompt_agent_helper").tag == "runAsync"
    assert disposition_for(deferred, "prompt_agent_helper").tag == "defer"
