"""Budgets on real worker processes, a real Redis and the scripted model server: a budget of two
model calls stops a session at the third with `budget_exceeded`, and `agents session resume
--grant` (the CLI, against the same workers) continues it; a child's tool calls exhaust its
parent's budget while the child runs; the fleet's spend is served by `/metrics` counters in Redis;
sibling sub-agents running at once never pass their parent's count together, and cross its token
limit with one model call at most."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.model import State
from celery_agents.store.counters import read_counters
from tests.cli.process import agents, cli_env
from tests.e2e.conftest import RECORD, runs, start_workers, wait_for
from tests.support.llm_server import LlmServer, calls, text
from tests.support.workers import stop_all

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, dict[str, str]]]:
    prefix = f"b{uuid.uuid4().hex[:10]}"
    home = tmp_path_factory.mktemp("home")
    workers = start_workers(redis_url, prefix, tmp_path_factory.mktemp("logs"), count=1, concurrency=2, step_threads=8)
    settings = Settings(redis_url=redis_url, prefix=prefix, home=home, sweep_interval=0.2, owed_grace=2.0)
    yield settings, cli_env(redis_url, prefix, home)
    stop_all(workers)


def lookup(log: Path) -> dict[str, Any]:
    return {
        "name": "lookup",
        "description": "looks something up",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "command": [sys.executable, str(RECORD), str(log), "lookup"],
    }


def agent(slug: str, model: str, server: LlmServer, **extra: Any) -> dict[str, Any]:
    return {"slug": slug, "model": f"openai/{model}", "apiBase": server.url, **extra}


def test_two_model_calls_stop_the_session_at_the_third_and_grant_continues_it(
    fleet: tuple[Settings, dict[str, str]], llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    settings, env = fleet
    log = tmp_path / "runs.jsonl"
    model = llm_server.scenario(
        [calls(("lookup", {"x": 1})), calls(("lookup", {"x": 2})), text("found it")]  # usage 10 + 5 each
    )
    path = write_agent(agent("spender", model, llm_server, tools=[lookup(log)], budget={"modelCalls": 2}))
    with Client(settings) as client:
        view = client.start(path, "look it up", run=True, timeout=60)
        assert view.state == State.FAILED and view.error is not None, view
        assert view.error.code == "budget_exceeded"
        assert "modelCalls spent 2, limit 2" in view.error.message
        assert llm_server.count(model) == 2, "the third model call was never made"
        assert len(runs(log, "lookup")) == 2
        assert view.to_json()["spent"] == {"tokens": 30, "costUsd": 0.0, "modelCalls": 2, "toolCalls": 2}

        refused = agents("session", "show", view.session_id, "--json", env=env)
        assert refused.doc["error"]["code"] == "budget_exceeded" and refused.doc["budget"]["modelCalls"] == 2

        resumed = agents("session", "resume", view.session_id, "--grant", "modelCalls=1", "--json", env=env)
        assert resumed.returncode == 0, resumed
        doc = resumed.doc
        assert (doc["state"], doc["response"], doc["error"]) == ("completed", "found it", None)
        assert doc["budget"]["modelCalls"] == 3 and doc["spent"]["modelCalls"] == 3 and doc["spent"]["tokens"] == 45
        assert llm_server.count(model) == 3

        bad = agents("session", "resume", view.session_id, "--grant", "steps=3", "--json", env=env)
        assert bad.returncode == 2 and bad.doc["error"]["code"] == "invalid_input"

        counted = read_counters(client.store.client, client.store.keys)
        assert counted[("spend", "tokens")] >= 45


def test_a_child_s_tool_calls_exhaust_the_parent_s_budget(
    fleet: tuple[Settings, dict[str, str]], llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    settings, _ = fleet
    log = tmp_path / "runs.jsonl"
    helper_model = llm_server.scenario([calls(("lookup", {"x": i})) for i in range(5)])
    write_agent(agent("helper", helper_model, llm_server, tools=[lookup(log)]), "helper.json")
    boss_model = llm_server.scenario(
        [calls(("prompt_agent_helper", {"prompt": "look everything up"})), text("the helper ran out")]
    )
    boss = agent("boss", boss_model, llm_server, subAgents=["helper.json"], budget={"toolCalls": 3})
    path = write_agent(boss, "boss.json")
    with Client(settings) as client:
        parent = client.start(path, "go", run=True, timeout=60)
        (child_id,) = parent.children
        child = client.view(child_id)
        # the delegation is the parent's first tool call; two of the child's lookups make three
        assert len(runs(log, "lookup")) == 2
        assert child.state == State.FAILED and child.error is not None and child.error.code == "budget_exceeded"
        assert f"toolCalls spent 3, limit 3 (the budget of session {parent.session_id} above it" in child.error.message
        assert llm_server.count(helper_model) == 3
        # the child's failure is the parent's failed call; the parent's own model calls are not bounded
        assert (parent.state, parent.response) == (State.COMPLETED, "the helper ran out"), parent
        assert parent.spent.tool_calls == 3 and parent.spent.model_calls == 2 + 3
        assert child.spent.tool_calls == 2 and child.spent.model_calls == 3


ADD = {
    "name": "add",
    "description": "adds two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    "python": "tests.tools.sample_tools:add",
}
#: the sub-agents one answer of the boss starts at once
SIBLINGS = 4
#: what each model call reports it spent: 500 tokens
USAGE = (400, 100)


def siblings(server: LlmServer, write_agent: Any, budget: dict[str, Any], **helper: Any) -> tuple[Any, str, str]:
    """A boss with `budget` whose first answer starts SIBLINGS helpers at once; each helper's model
    asks for a sum after every answer, slowly (their calls overlap), until a budget stops it."""
    helper_model = server.scenario([calls(("add", {"a": 1, "b": 2}), delay=0.3, usage=USAGE)] * 100)
    write_agent(agent("helper", helper_model, server, tools=[ADD], **helper), "helper.json")
    starts = [("prompt_agent_helper", {"prompt": f"add, part {i}"}) for i in range(SIBLINGS)]
    boss_model = server.scenario([calls(*starts, usage=USAGE), text("the helpers stopped", usage=USAGE)])
    path = write_agent(agent("boss", boss_model, server, subAgents=["helper.json"], budget=budget), "boss.json")
    return path, boss_model, helper_model


def test_siblings_running_at_once_never_pass_their_parent_s_model_call_limit_together(
    fleet: tuple[Settings, dict[str, str]], llm_server: LlmServer, write_agent: Any
) -> None:
    settings, _ = fleet
    path, boss_model, helper_model = siblings(llm_server, write_agent, {"modelCalls": 7})
    with Client(settings) as client:
        boss = client.start(path, "go", run=True, timeout=90)
        helpers = [client.view(c) for c in boss.children]
    assert len(helpers) == SIBLINGS
    made = llm_server.count(boss_model) + llm_server.count(helper_model)
    assert made == 7 and boss.spent.model_calls == 7, f"{made} model calls made under a limit of 7"
    assert all(h.error is not None and h.error.code == "budget_exceeded" for h in helpers), helpers
    # the boss's own last call was refused too: its limit is spent
    assert boss.error is not None and "modelCalls spent 7, limit 7 (the session's budget" in boss.error.message


def test_siblings_running_at_once_cross_their_parent_s_token_limit_with_one_call_at_most(
    fleet: tuple[Settings, dict[str, str]], llm_server: LlmServer, write_agent: Any
) -> None:
    """Each call spends 500 tokens. With `max_tokens` the helpers' calls have a bound (their
    prompt's bytes, a few tokens a message, 100 for the answer: under 1,000), so they run side by
    side while their bounds fit in what is left of the 5,800, and one at a time near it."""
    settings, _ = fleet
    limit = 5800
    path, boss_model, helper_model = siblings(
        llm_server, write_agent, {"tokens": limit}, modelParams={"max_tokens": 100}
    )
    with Client(settings) as client:
        boss = client.start(path, "go", run=True, timeout=90)
        helpers = [client.view(c) for c in boss.children]
    made = llm_server.count(boss_model) + llm_server.count(helper_model)
    assert boss.spent.tokens == made * 500
    assert limit <= boss.spent.tokens < limit + 500, f"{boss.spent.tokens} tokens spent: passed by more than one call"
    assert all(h.error is not None and h.error.code == "budget_exceeded" for h in helpers), helpers
    assert max(h.spent.model_calls for h in helpers) >= 2


def test_a_fork_and_a_rerun_keep_the_agents_budget_counting_from_the_fork(
    fleet: tuple[Settings, dict[str, str]], llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    """A fork is a session of its own with its agent file's budget: what the origin spent before
    the fork is the origin's, and the fork may spend its budget again, no more. (A fork that had
    no budget let a model that always asks for more run to `maxSteps`.)"""
    settings, _ = fleet
    log = tmp_path / "runs.jsonl"
    model = llm_server.scenario([lambda body: calls(("lookup", {"x": len(body["messages"])}))])
    path = write_agent(agent("forever", model, llm_server, tools=[lookup(log)], budget={"modelCalls": 2}))
    with Client(settings) as client:
        origin = client.start(path, "look it up", run=True, timeout=60)
        assert origin.error is not None and origin.error.code == "budget_exceeded"
        assert llm_server.count(model) == 2
        fork = client.fork(origin.session_id)
        assert fork.to_json()["budget"]["modelCalls"] == 2 and fork.to_json()["spent"]["modelCalls"] == 0
        fork = client.resume(fork.session_id, timeout=60)
        assert fork.error is not None and fork.error.code == "budget_exceeded", fork
        assert fork.to_json()["spent"]["modelCalls"] == 2 and llm_server.count(model) == 4
        rerun = client.rerun(origin.session_id, from_version=1, timeout=60)
        assert rerun.error is not None and rerun.error.code == "budget_exceeded", rerun
        assert rerun.to_json()["spent"]["modelCalls"] == 2 and llm_server.count(model) == 6
        assert client.store.header(origin.session_id).spent.model_calls == 2, "the origin's spend is unchanged"


def test_a_fork_counts_the_calls_it_runs_again(
    fleet: tuple[Settings, dict[str, str]], llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    """Forked while the origin's runAsync call runs, the fork runs that call again: a tool call
    of its own, counted from the start, so its budget of one tool call is spent by it."""
    settings, _ = fleet
    log = tmp_path / "runs.jsonl"
    model = llm_server.scenario([lambda body: calls(("lookup", {"x": len(body["messages"]), "sleep": 1}))])
    spec = agent("async", model, llm_server, tools=[lookup(log)], budget={"toolCalls": 1})
    spec["toolCallPolicy"] = {"default": "runSync", "rules": [{"tool": "lookup", "disposition": "runAsync"}]}
    path = write_agent(spec)
    with Client(settings) as client:
        origin = client.start(path, "look it up", run=True, wait=False)
        wait_for(lambda: runs(log, "lookup", phase="start"), what="the origin's call to start")
        fork = client.fork(origin.session_id)
        assert fork.to_json()["spent"]["toolCalls"] == 1, "the copied call it runs again"
        fork = client.resume(fork.session_id, timeout=60)
        assert fork.error is not None and "toolCalls spent 1, limit 1" in fork.error.message, fork
        wait_for(lambda: client.view(origin.session_id).state == State.FAILED, what="the origin to stop")
    assert len(runs(log, "lookup", phase="start")) == 2, "once for the origin, once again for the fork"
