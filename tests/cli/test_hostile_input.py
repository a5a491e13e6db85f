"""Input a user or another program hands the CLI that is too big or too deep for it: agent files,
result files and prompts are refused with the contract's error documents (exit 2), never a
traceback; the limits are AGENTS_MAX_RESULT_BYTES and AGENTS_MAX_PROMPT_BYTES."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from tests.cli.process import DEMO_AGENT, agents, cli_env

DEEP = 100_000


def deferred_token(settings: Settings) -> str:
    """A token of the demo agent's booking, which waits on a person."""
    with Client(settings, inline=True) as client:
        view = client.start(DEMO_AGENT, "Please book a table in Paris.", run=True)
        [pending] = view.pending
        assert pending.token
        return pending.token


def refused(run: Any, code: str) -> dict[str, Any]:
    assert run.returncode == 2, run
    assert "Traceback" not in run.stderr, run
    doc = run.doc
    assert doc["error"]["code"] == code, run
    return doc


@pytest.mark.parametrize(
    "text",
    [
        '{"slug": "x", "model": "demo/echo", "modelParams": {"a": ' + "[" * DEEP + "]" * DEEP + "}}",
        '{"slug": "x", "model": "demo/echo", "maxSteps": ' + "9" * 100_000 + "}",
        '{"slug": "x", "model": "demo/echo", "modelParams": {"a": ' + "[" * 500 + "]" * 500 + "}}",
    ],
    ids=["deeply-nested", "huge-integer", "nested-500"],
)
def test_a_hostile_agent_file_is_an_invalid_agent_file(text: str, redis_url: str, prefix: str, tmp_path: Path) -> None:
    path = tmp_path / "agent.json"
    path.write_text(text)
    env = cli_env(redis_url, prefix)
    doc = refused(agents("session", "start", "--agent-file", path, "-p", "hi", "--json", env=env), "invalid_agent_file")
    assert str(path) in doc["error"]["message"]
    human = agents("session", "start", "--agent-file", path, "-p", "hi", env=env)
    assert human.returncode == 2 and "Traceback" not in human.stderr and str(path) in human.stderr, human


@pytest.mark.parametrize(
    "text",
    ["[" * DEEP + "]" * DEEP, "9" * 100_000, json.dumps({"rows": "x" * (1024 * 1024 + 1)})],
    ids=["deeply-nested", "huge-integer", "over-the-limit"],
)
def test_a_hostile_result_file_is_an_invalid_result(
    text: str, settings: Settings, write_agent: Any, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    token = deferred_token(settings)
    result = tmp_path / "result.json"
    result.write_text(text)
    env = cli_env(redis_url, prefix)
    refused(agents("session", "complete", token, result, "--json", env=env), "invalid_result")
    with Client(settings, inline=True) as client:
        [still] = client.pending()
        assert still.token == token, "the refused result changed nothing: the call still waits"


def test_the_result_limit_is_a_setting(
    settings: Settings, write_agent: Any, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    token = deferred_token(settings)
    result = tmp_path / "result.txt"
    result.write_text("x" * 2000)
    env = cli_env(redis_url, prefix, AGENTS_MAX_RESULT_BYTES="1000")
    doc = refused(agents("session", "complete", token, result, "--json", env=env), "invalid_result")
    assert "AGENTS_MAX_RESULT_BYTES" in doc["error"]["message"]
    env = cli_env(redis_url, prefix, AGENTS_MAX_RESULT_BYTES="5000")
    done = agents("session", "complete", token, result, "--json", env=env)
    assert done.returncode == 0 and done.doc["accepted"] is True, done


def test_a_prompt_over_the_limit_is_refused_before_anything_is_stored(
    redis_url: str, prefix: str, tmp_path: Path, write_agent: Any, rclient: Any
) -> None:
    agent = write_agent({"slug": "echo", "model": "demo/echo"})
    big = tmp_path / "big.txt"
    big.write_text("y" * (1024 * 1024 + 1))
    env = cli_env(redis_url, prefix)
    doc = refused(agents("session", "start", "--agent-file", agent, "--file", big, "--json", env=env), "invalid_input")
    assert "AGENTS_MAX_PROMPT_BYTES" in doc["error"]["message"]
    assert not list(rclient.scan_iter(match=f"{prefix}:s:*")), "no session was stored"
    small = agents("session", "start", "--agent-file", agent, "-p", "hello", "--json", env=env)
    assert small.returncode == 0, small
