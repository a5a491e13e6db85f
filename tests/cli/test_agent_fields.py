"""Agent-file fields through a real `agents` process: a typo at any level is refused before
anything is stored, naming the closest known field; fields of agents-exe files that celery-agents
does not use start with a warning naming them; fields added this release are accepted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.cli.process import agents, check_error, ok

BASE: dict[str, Any] = {
    "slug": "fields",
    "model": "demo/weather",
    "tools": [{"name": "t", "description": "a tool", "command": ["true"]}],
    "toolCallPolicy": {"default": "runSync", "rules": [{"tool": "t", "disposition": {"tag": "runAsync"}}]},
}


def with_change(path: tuple[Any, ...], key: str, value: Any) -> dict[str, Any]:
    agent = json.loads(json.dumps(BASE))
    node: Any = agent
    for part in path:
        node = node[part]
    node[key] = value
    return agent


TYPOS = [
    ((), "systemPromt", "hi", "systemPromt", "systemPrompt"),
    ((), "toolCallPolcy", {"default": "runSync"}, "toolCallPolcy", "toolCallPolicy"),
    ((), "maxStep", 3, "maxStep", "maxSteps"),
    (("tools", 0), "paramters", {}, "tools[0].paramters", "parameters"),
    (("tools", 0), "descripton", "x", "tools[0].descripton", "description"),
    (("toolCallPolicy",), "rule", [], "toolCallPolicy.rule", "rules"),
    (("toolCallPolicy", "rules", 0), "disposion", "runSync", "toolCallPolicy.rules[0].disposion", "disposition"),
    (
        ("toolCallPolicy", "rules", 0, "disposition"),
        "timeoutSecond",
        3,
        "toolCallPolicy.rules[0].disposition.timeoutSecond",
        "timeoutSeconds",
    ),
    (("toolCallPolicy", "rules", 0, "disposition"), "retry", 2, "disposition.retry", "retries"),
    (("toolCallPolicy", "rules", 0), "network", True, "rules[0].network", "disposition.network"),
]


@pytest.mark.parametrize(("path", "key", "value", "where", "suggestion"), TYPOS, ids=[t[1] for t in TYPOS])
def test_a_typo_is_refused_with_the_closest_known_field(
    qenv: dict[str, str], tmp_path: Path, path: tuple[Any, ...], key: str, value: Any, where: str, suggestion: str
) -> None:
    agent = tmp_path / "typo.json"
    agent.write_text(json.dumps(with_change(path, key, value)))
    err = check_error(
        agents("session", "start", "--agent-file", agent, "-p", "x", "--json", env=qenv), "invalid_agent_file"
    )
    assert str(agent) in err["message"] and where in err["message"], err
    assert f"did you mean {suggestion}?" in err["message"], err


def test_fields_of_agents_exe_files_we_do_not_use_are_accepted_with_a_warning(
    qenv: dict[str, str], tmp_path: Path
) -> None:
    agent = tmp_path / "exe.json"
    data = with_change((), "announce", "an agent")
    data.update({"flavor": "OpenAIv1", "asyncYieldStrategy": "yieldWhenAllDone"})
    data["toolCallPolicy"]["wrappers"] = []
    agent.write_text(json.dumps(data))
    run = agents("session", "start", "--agent-file", agent, "-p", "x", env=qenv)
    assert run.returncode == 0, str(run)
    warning = next(line for line in run.stderr.splitlines() if line.startswith("warning:"))
    for name in ("announce", "flavor", "asyncYieldStrategy", "toolCallPolicy.wrappers"):
        assert name in warning, run.stderr


def test_fields_of_this_release_are_known(qenv: dict[str, str], tmp_path: Path) -> None:
    agent = tmp_path / "new.json"
    data = with_change((), "maxToolCallsPerTurn", 8)
    data.update({"description": "an agent", "maxDepth": 2, "mcpServers": [], "subAgents": [], "extraAgents": []})
    data["toolCallPolicy"]["rules"][0]["disposition"]["network"] = False
    agent.write_text(json.dumps(data))
    view = ok(agents("session", "start", "--agent-file", agent, "-p", "x", "--json", env=qenv))
    assert view["state"] == "ready"
