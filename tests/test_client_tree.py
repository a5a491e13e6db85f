"""Sub-agents and follow-ups with steps run in this process (inline, as on the embedded default):
a child is driven here and its end wakes the parent; a child that defers leaves the tree waiting
until its token is completed; an approved delegation runs its child here, a completed one none."""

from __future__ import annotations

from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.errors import SessionNotAdvanceable
from celery_agents.model import LlmTurn, State
from celery_agents.scheduler import LlmRequest
from celery_agents.tools.resolve import parse_agent
from tests.scheduler.fakes import llm_turn

HELPER = {"slug": "helper", "model": "fake/helper", "tools": [{"name": "approve", "external": True}]}


class ByModel:
    """A model per agent: each answers its scripted turns in order."""

    def __init__(self, **scripts: list[LlmTurn]) -> None:
        self.scripts = scripts
        self.asked: list[tuple[str, str]] = []

    def complete(self, request: LlmRequest) -> LlmTurn:
        name = request.agent.model.split("/")[1]
        self.asked.append((name, str(request.messages[-1].get("content"))))
        return self.scripts[name].pop(0)


def boss(**extra: Any) -> Any:
    return parse_agent({"slug": "boss", "model": "fake/boss", "subAgents": [HELPER], **extra})


def delegate() -> LlmTurn:
    return llm_turn(("d1", "prompt_agent_helper", '{"prompt": "find it"}'))


def test_inline_a_child_runs_here_and_its_answer_reaches_the_parent(settings: Settings) -> None:
    llm = ByModel(boss=[delegate(), llm_turn(text="boss done")], helper=[llm_turn(text="found it")])
    with Client(settings, inline=True, llm=llm) as client:
        view = client.start(boss(), "go", run=True)
        assert (view.state, view.response) == (State.COMPLETED, "boss done")
        assert ("helper", "find it") in llm.asked and llm.asked[-1] == ("boss", "found it")
        (child,) = view.children
        assert client.view(child).parent == view.session_id


def test_inline_a_deferring_child_waits_and_its_completion_finishes_the_tree(settings: Settings) -> None:
    llm = ByModel(
        boss=[delegate(), llm_turn(text="boss done")],
        helper=[llm_turn(("a1", "approve", "{}")), llm_turn(text="approved")],
    )
    with Client(settings, inline=True, llm=llm) as client:
        view = client.start(boss(), "go", run=True)
        assert view.state == State.WAITING
        delegation, deferred = client.pending(view.session_id)
        assert (delegation.session_id, delegation.tool, delegation.state) == (
            view.session_id,
            "prompt_agent_helper",
            "running",
        )
        assert deferred.session_id == view.children[0] and deferred.tool == "approve"
        client.complete(deferred.token or "", "yes")
        client.resume(view.session_id)  # the parent's drive drives its child on
        final = client.view(view.session_id)
        assert (final.state, final.response) == (State.COMPLETED, "boss done")


def test_inline_an_approved_delegation_runs_its_child(settings: Settings) -> None:
    rule = {"tool": "prompt_agent_helper", "disposition": "defer"}
    llm = ByModel(boss=[delegate(), llm_turn(text="boss done")], helper=[llm_turn(text="found it")])
    with Client(settings, inline=True, llm=llm) as client:
        view = client.start(boss(toolCallPolicy={"default": "runSync", "rules": [rule]}), "go", run=True)
        (call,) = view.pending
        assert view.state == State.WAITING and call.token and (call.kind, call.then) == ("approval", "runAsync")
        assert client.approve(call.token).decision == "approved"
        final = client.view(view.session_id)
        assert (final.state, final.response, len(final.children)) == (State.COMPLETED, "boss done", 1)
        assert ("helper", "find it") in llm.asked


def test_inline_completing_a_deferred_delegation_responds_and_starts_no_child(settings: Settings) -> None:
    """A deferred delegation is a gate: `complete` records the result a person gives ("respond"),
    as for any gate; only `approve` starts the child."""
    rule = {"tool": "prompt_agent_helper", "disposition": "defer"}
    llm = ByModel(boss=[delegate(), llm_turn(text="boss done")], helper=[llm_turn(text="found it")])
    with Client(settings, inline=True, llm=llm) as client:
        view = client.start(boss(toolCallPolicy={"default": "runSync", "rules": [rule]}), "go", run=True)
        (call,) = view.pending
        assert client.complete(call.token or "", "it is in the drawer").decision == "responded"
        final = client.resume(view.session_id)
        assert (final.state, final.response, final.children) == (State.COMPLETED, "boss done", [])
        assert [name for name, _ in llm.asked] == ["boss", "boss"], "the helper was never asked"
        assert llm.asked[-1] == ("boss", "it is in the drawer"), "the model got the given result"


def test_inline_send_continues_the_conversation(settings: Settings) -> None:
    llm = ByModel(boss=[llm_turn(text="one"), llm_turn(text="two")])
    with Client(settings, inline=True, llm=llm) as client:
        view = client.start(boss(), "first", run=True)
        assert client.send(view.session_id, "second", run=True).response == "two"
        assert llm.asked[-1] == ("boss", "second")


def test_pending_of_a_parent_whose_child_was_deleted_lists_the_parents_calls(settings: Settings) -> None:
    llm = ByModel(boss=[delegate(), llm_turn(text="boss done")], helper=[llm_turn(text="found it")])
    with Client(settings, inline=True, llm=llm) as client:
        view = client.start(boss(), "go", run=True)
        (child,) = view.children
        client.delete(child)  # as `session delete` or retention, which reaches a child before its parent
        assert client.pending(view.session_id) == []


def test_cancelling_an_ended_parent_still_cancels_a_child_that_goes_on(settings: Settings) -> None:
    # A completed parent whose child was sent a follow-up: the child waits on a deferred call.
    llm = ByModel(
        boss=[delegate(), llm_turn(text="boss done")],
        helper=[llm_turn(text="found it"), llm_turn(("a1", "approve", "{}"))],
    )
    with Client(settings, inline=True, llm=llm) as client:
        view = client.start(boss(), "go", run=True)
        (child,) = view.children
        assert view.state == State.COMPLETED
        assert client.send(child, "and check it again", run=True).state == State.WAITING
        with pytest.raises(SessionNotAdvanceable):  # the parent itself had ended: exit 5, as before
            client.cancel(view.session_id)
        assert client.view(child).state == State.CANCELLED
        assert client.pending(view.session_id) == []
