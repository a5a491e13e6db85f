"""Budgets with steps run in this process on a real Redis: a session stops at the call that would
pass a limit, with `budget_exceeded` naming the limit, the spend and the limit; `resume --grant`
raises it and the session goes on; a sub-agent's spend counts against its parent while it runs; an
agent file's `pricing` gives the cost, against the local model server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.model import Budget, LlmTurn, State, Usage
from celery_agents.tools.resolve import parse_agent
from tests.scheduler.fakes import RecordingTools, ScriptedLlm, llm_turn
from tests.support.llm_server import LlmServer, calls, text
from tests.test_client_tree import ByModel

LOOKUP = {"name": "lookup", "python": "tests.x:y", "parameters": {"type": "object", "properties": {}}}


def agent(budget: dict[str, Any], **extra: Any) -> Any:
    return parse_agent({"slug": "spender", "model": "fake/model", "tools": [LOOKUP], "budget": budget, **extra})


def ask(n: int, *, tokens: int = 12) -> Any:
    """The model's `n`th answer: one lookup, `tokens` spent."""
    return llm_turn((f"c{n}", "lookup", "{}"), usage=Usage(total_tokens=tokens))


def test_two_model_calls_stop_the_session_at_the_third_and_a_grant_continues_it(settings: Settings) -> None:
    llm = ScriptedLlm(ask(1), ask(2), llm_turn(text="done"))
    tools = RecordingTools()
    with Client(settings, inline=True, llm=llm, tools=tools) as client:
        view = client.start(agent({"modelCalls": 2}), "go", run=True)
        assert view.state == State.FAILED and view.error is not None
        assert view.error.code == "budget_exceeded"
        assert "modelCalls spent 2, limit 2" in view.error.message
        assert llm.calls == 2, "the third model call was never made"
        assert len(tools.ran) == 2, "the tools the second answer asked for ran: a tool call is not a model call"
        assert (view.spent.model_calls, view.spent.tool_calls, view.spent.tokens) == (2, 2, 24)
        assert view.budget == Budget(model_calls=2)
        assert view.to_json()["spent"] == {"tokens": 24, "costUsd": 0.0, "modelCalls": 2, "toolCalls": 2}
        assert view.to_json()["budget"] == {"tokens": None, "costUsd": None, "modelCalls": 2, "toolCalls": None}

        again = client.resume(view.session_id, grant=Budget(model_calls=1))
        assert (again.state, again.response, again.error) == (State.COMPLETED, "done", None)
        assert again.budget == Budget(model_calls=3) and again.spent.model_calls == 3


def test_a_token_limit_is_passed_by_the_one_call_that_crossed_it_never_by_two(settings: Settings) -> None:
    llm = ScriptedLlm(ask(1, tokens=8), ask(2, tokens=8), llm_turn(text="never"))
    with Client(settings, inline=True, llm=llm, tools=RecordingTools()) as client:
        view = client.start(agent({"tokens": 10}), "go", run=True)
        assert view.error is not None and view.error.code == "budget_exceeded"
        assert "tokens spent 16, limit 10" in view.error.message
        assert llm.calls == 2 and view.spent.tokens == 16


def test_tool_calls_past_the_limit_in_one_answer_never_run_and_a_grant_goes_on(settings: Settings) -> None:
    three = llm_turn(*((f"c{i}", "lookup", "{}") for i in range(3)))
    llm = ScriptedLlm(three, llm_turn(text="done"))
    tools = RecordingTools()
    with Client(settings, inline=True, llm=llm, tools=tools) as client:
        view = client.start(agent({"toolCalls": 2}), "go", run=True)
        assert view.state == State.FAILED and view.error is not None and view.error.code == "budget_exceeded"
        assert "toolCalls spent 2, limit 2" in view.error.message
        assert tools.ran == ["c0", "c1"] and view.spent.tool_calls == 2
        done = client.resume(view.session_id, grant=Budget(tool_calls=5))
        assert done.state == State.COMPLETED
        # the model heard of the call that was not run, as an error it can act on
        told = [m for m in llm.requests[-1].messages if m.get("role") == "tool"]
        assert [m["tool_call_id"] for m in told] == ["c0", "c1", "c2"]
        assert "not run: budget exceeded" in str(told[2]["content"])


def test_runasync_calls_within_the_limit_run_though_the_step_stopped_the_session(settings: Settings) -> None:
    """One answer asks for five runAsync calls against a limit of two: the session fails
    budget_exceeded in the commit that dispatches the two within it, and those two run all the
    same (their results wait for the grant), where they stayed queued for ever."""
    five = llm_turn(*((f"c{i}", "lookup", "{}") for i in range(5)))
    llm = ScriptedLlm(five, llm_turn(text="done"))
    tools = RecordingTools()
    spender = agent({"toolCalls": 2}, executionMode="asynchronous", toolCallPolicy={"default": "runAsync", "rules": []})
    with Client(settings, inline=True, llm=llm, tools=tools) as client:
        view = client.start(spender, "go", run=True)
        assert view.state == State.FAILED and view.error is not None and view.error.code == "budget_exceeded"
        assert sorted(tools.ran) == ["c0", "c1"], "the two within the limit ran"
        assert view.spent.tool_calls == 2
        assert client.pending(view.session_id) == [], "nothing is left queued"
        done = client.resume(view.session_id, grant=Budget(tool_calls=5))
        assert done.state == State.COMPLETED and sorted(tools.ran) == ["c0", "c1"]


def test_a_child_s_tool_calls_exhaust_the_parent_s_budget(settings: Settings) -> None:
    helper = {"slug": "helper", "model": "fake/helper", "tools": [LOOKUP]}
    boss = parse_agent(
        {"slug": "boss", "model": "fake/boss", "subAgents": [helper], "budget": {"toolCalls": 3, "tokens": 1000}}
    )
    llm = ByModel(
        boss=[llm_turn(("d1", "prompt_agent_helper", '{"prompt": "look"}')), llm_turn(text="gave up")],
        helper=[ask(1), ask(2), ask(3), llm_turn(text="never")],
    )
    tools = RecordingTools()
    with Client(settings, inline=True, llm=llm, tools=tools) as client:
        view = client.start(boss, "go", run=True)
        (child_id,) = view.children
        child = client.view(child_id)
        # the delegation is the parent's first tool call; the child's two lookups make three
        assert len(tools.ran) == 2
        assert child.state == State.FAILED and child.error is not None and child.error.code == "budget_exceeded"
        assert f"toolCalls spent 3, limit 3 (the budget of session {view.session_id} above it" in child.error.message
        assert child.budget is None and child.spent.tool_calls == 2
        # the parent's spend holds the child's: its tool calls and its model calls' tokens
        assert (view.state, view.response) == (State.COMPLETED, "gave up")
        assert view.spent.tool_calls == 3
        assert view.spent.model_calls == 2 + 3 and view.spent.tokens == 2 * 12 + 3 * 12


def test_a_cost_limit_counts_the_cost_the_model_calls_carry(settings: Settings) -> None:
    priced = [llm_turn((f"c{n}", "lookup", "{}"), usage=Usage(total_tokens=5, cost=0.004)) for n in range(3)]
    llm = ScriptedLlm(*priced, llm_turn(text="never"))
    with Client(settings, inline=True, llm=llm, tools=RecordingTools()) as client:
        view = client.start(agent({"costUsd": 0.01}), "go", run=True)
        assert view.error is not None and view.error.code == "budget_exceeded"
        assert "costUsd spent 0.012, limit 0.01" in view.error.message
        assert llm.calls == 3 and abs(view.spent.cost_usd - 0.012) < 1e-12
        fleet = client.store.counters()
        assert abs(fleet[("spend", "cost")] - 0.012) < 1e-12 and fleet[("spend", "tokens")] == 15


def test_a_grandchild_is_bound_by_its_grandparent_s_budget_through_a_parent_without_one(settings: Settings) -> None:
    scout = {"slug": "scout", "model": "fake/scout", "tools": [LOOKUP]}
    helper = {"slug": "helper", "model": "fake/helper", "subAgents": [scout]}
    boss = parse_agent({"slug": "boss", "model": "fake/boss", "subAgents": [helper], "budget": {"toolCalls": 2}})
    llm = ByModel(
        boss=[llm_turn(("d1", "prompt_agent_helper", '{"prompt": "ask the scout"}')), llm_turn(text="done")],
        helper=[llm_turn(("d2", "prompt_agent_scout", '{"prompt": "look"}')), llm_turn(text="no luck")],
        scout=[ask(1), llm_turn(text="never")],
    )
    tools = RecordingTools()
    with Client(settings, inline=True, llm=llm, tools=tools) as client:
        top = client.start(boss, "go", run=True)
        (helper_id,) = top.children
        (scout_id,) = client.view(helper_id).children
        found = client.view(scout_id)
        assert tools.ran == [], "the two delegations spent the budget: the scout's lookup never ran"
        assert found.error is not None and found.error.code == "budget_exceeded"
        assert f"the budget of session {top.session_id} above it" in found.error.message
        assert (top.state, top.response) == (State.COMPLETED, "done")
        assert top.spent.tool_calls == 2 and client.view(helper_id).spent.tool_calls == 1


def test_a_model_call_whose_commit_is_refused_is_spent_all_the_same(settings: Settings) -> None:
    from celery_agents.store import Store
    from tests.store.scenario import begin, commit, decide, start

    with Client(settings, inline=True) as client:
        store: Store = client.store
        sid = start(store, agent=agent({"modelCalls": 5}))
        loaded = begin(store, sid)
        # a worker frozen past its lease: another took the step over and committed it first
        late = decide(store, loaded, llm=ScriptedLlm(ask(1, tokens=7)))
        first = decide(store, loaded, llm=ScriptedLlm(ask(1, tokens=7)))
        assert commit(store, sid, loaded, first).outcome == "ok"
        assert commit(store, sid, loaded, late).outcome == "stale"
        spent = store.header(sid).spent
        assert (spent.model_calls, spent.tokens) == (2, 14), "both model calls were made and paid for"


def test_an_approval_gate_counts_as_the_tool_call_it_runs_on_approval(settings: Settings) -> None:
    """A gate's call runs once approved: it is checked against the budget and counted when it is
    asked, like any call that starts; past the limit nobody is asked and it never runs."""
    gated = {"rules": [{"tool": "lookup", "disposition": {"tag": "defer", "then": "runSync", "reason": "ask"}}]}
    two = llm_turn(("c0", "lookup", "{}"), ("c1", "lookup", "{}"))
    llm = ScriptedLlm(two, llm_turn(text="done"))
    tools = RecordingTools()
    with Client(settings, inline=True, llm=llm, tools=tools) as client:
        view = client.start(agent({"toolCalls": 1}, toolCallPolicy={"default": "runSync", **gated}), "go", run=True)
        assert view.spent.tool_calls == 1, view.spent
        assert [p.call_id for p in view.pending] == ["c0"], "the second gate was past the budget: nobody is asked"
        assert view.error is not None and view.error.code == "budget_exceeded"
        (gate,) = view.pending
        client.approve(gate.token or "", digest=gate.digest)
        done = client.resume(view.session_id, grant=Budget(tool_calls=1))
        assert (done.state, done.response) == (State.COMPLETED, "done"), done
        assert tools.ran == ["c0"], "the approved call ran, the other never did"
        assert done.spent.tool_calls == 1, "counted once: when asked, not again when it ran"


FORECAST = {"name": "forecast", "description": "a forecast", "python": "tests.tools.sample_tools:forecast"}


@pytest.fixture
def own_llm_server() -> Iterator[LlmServer]:
    """A model server of the test's own: the model's name is a real one, which other tests (in the
    same process, on the shared server) call too, and this test counts its requests."""
    server = LlmServer().start()
    yield server
    server.stop()


def test_an_agent_file_s_prices_are_the_cost_its_budget_counts(settings: Settings, own_llm_server: LlmServer) -> None:
    """A model litellm prices (gpt-4o-mini at $0.15/$0.60 per million tokens) priced by the file at
    $2/$8 instead: each call of 1,000 prompt and 500 completion tokens costs $0.006, so a $0.01
    budget stops the session at its third call (at litellm's price the third call would be made)."""
    llm_server = own_llm_server
    forecast = calls(("forecast", {"city": "Paris"}), usage=(1000, 500))
    llm_server.script("gpt-4o-mini", [forecast, forecast, text("never", usage=(1000, 500))])
    spec = parse_agent(
        {
            "slug": "priced",
            "model": "openai/gpt-4o-mini",
            "apiBase": llm_server.url,
            "tools": [FORECAST],
            "pricing": {"inputPerMTokUsd": 2, "outputPerMTokUsd": 8},
            "budget": {"costUsd": 0.01},
        }
    )
    with Client(settings, inline=True) as client:
        view = client.start(spec, "go", run=True)
        assert view.error is not None and view.error.code == "budget_exceeded", view
        assert "costUsd spent 0.012, limit 0.01" in view.error.message
        assert llm_server.count("gpt-4o-mini") == 2, "the third model call was never made"
        assert abs(view.spent.cost_usd - 0.012) < 1e-12
        turns = client.store.turns(view.session_id)
        costs = [t.usage.cost for t in turns if isinstance(t, LlmTurn)]
        assert costs == [pytest.approx(0.006)] * 2, "each turn records the file's price"


def test_a_model_litellm_cannot_price_costs_what_the_file_says(settings: Settings, llm_server: LlmServer) -> None:
    scenario = llm_server.scenario([text("done", usage=(2_000_000, 1_000_000))])
    priced = {"inputPerMTokUsd": 0.5, "outputPerMTokUsd": 1.5}
    spec = parse_agent({"slug": "own", "model": f"openai/{scenario}", "apiBase": llm_server.url, "pricing": priced})
    with Client(settings, inline=True) as client:
        view = client.start(spec, "go", run=True)
        assert view.state == State.COMPLETED
        assert view.spent.cost_usd == pytest.approx(2.5) and view.usage.cost == pytest.approx(2.5)


def test_an_approved_delegation_is_the_tool_call_counted_when_asked_and_past_the_limit_nobody_is_asked(
    settings: Settings,
) -> None:
    """A sub-agent call a person must approve first (a deferred delegation) is a gate whose `then`
    starts the child: counted when asked; once approved the child starts without being counted
    again, and its spend is its parent's."""
    helper = {"slug": "helper", "model": "fake/helper"}
    asked = {"rules": [{"tool": "prompt_agent_helper", "disposition": {"tag": "defer", "reason": "ask"}}]}
    boss = parse_agent(
        {
            "slug": "boss",
            "model": "fake/boss",
            "subAgents": [helper],
            "toolCallPolicy": {"default": "runSync", **asked},
            "budget": {"toolCalls": 1},
        }
    )
    two = llm_turn(
        ("d1", "prompt_agent_helper", '{"prompt": "one"}'), ("d2", "prompt_agent_helper", '{"prompt": "two"}')
    )
    llm = ByModel(boss=[two, llm_turn(text="boss done")], helper=[llm_turn(text="found", usage=Usage(total_tokens=7))])
    with Client(settings, inline=True, llm=llm, tools=RecordingTools()) as client:
        view = client.start(boss, "go", run=True)
        assert [p.call_id for p in view.pending] == ["d1"], "the second delegation was past the budget: nobody asked"
        assert view.error is not None and "toolCalls spent 1, limit 1" in view.error.message
        assert view.spent.tool_calls == 1 and view.children == []
        (gate,) = view.pending
        client.approve(gate.token or "", digest=gate.digest)
        # No grant: the limit is spent, and the approved delegation runs all the same (its one tool
        # call was counted when it was asked); the boss's last model call is under no limit.
        done = client.resume(view.session_id)
        assert (done.state, done.response) == (State.COMPLETED, "boss done"), done
        (child,) = done.children
        assert client.view(child).response == "found", "approved, the child ran"
        assert done.spent.tool_calls == 1, "counted once: when asked, not again when the child started"
        assert (done.spent.model_calls, done.spent.tokens) == (3, 7 + 2 * 12)


def test_limits_and_grants_stay_numbers_the_budget_reads_back_exactly(settings: Settings) -> None:
    """Redis's scripts add a grant as a Lua number and write the budget back with 14 significant
    digits: a grant of 9223372036854775000 model calls came back as 9.2233720368548e+18, which no
    integer parser reads, and every `session list` of the prefix failed. Limits and grants beyond
    10^13 (costUsd 10^9, and never inf or nan) are refused; a sum of grants stays at the bound."""
    from celery_agents.model.budget import MAX_COUNT_LIMIT, parse_grant

    for grant in ("modelCalls=9223372036854775000", "tokens=99999999999999999999", "costUsd=inf", "costUsd=1e308"):
        with pytest.raises(ValueError, match=r"less than or equal|finite"):
            parse_grant(grant)
    with pytest.raises(Exception, match="less than or equal"):
        agent({"modelCalls": 10**18})
    llm = ScriptedLlm(ask(1), ask(2), ask(3), llm_turn(text="done"))
    with Client(settings, inline=True, llm=llm, tools=RecordingTools()) as client:
        view = client.start(agent({"modelCalls": 1}), "go", run=True)
        assert view.error is not None and view.error.code == "budget_exceeded"
        for _ in range(3):  # each at the bound: their sum is kept at it
            view = client.resume(view.session_id, grant=parse_grant(f"modelCalls={MAX_COUNT_LIMIT}"), wait=False)
        assert client.show(view.session_id).budget == Budget(model_calls=MAX_COUNT_LIMIT)
        assert view.session_id in [v.session_id for v in client.list()]
