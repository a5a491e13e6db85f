"""Every transition of `advance`, with scripted ports: no Redis, no Celery."""

from __future__ import annotations

import pytest

from celery_agents.model import CallOutcome, CallState, LlmTurn, State, Status, ToolCall, TrackedCall, UserTurn
from celery_agents.scheduler import LlmFailure, Transition, advance
from tests.scheduler.fakes import (
    RecordingTools,
    ScriptedLlm,
    TickingClock,
    ask,
    llm_turn,
    make_agent,
    ports,
    snapshot,
)

AGENT = make_agent()


def run_tools(
    turn: LlmTurn,
    tools: RecordingTools | None = None,
    clock: TickingClock | None = None,
    agent: object = AGENT,
) -> Transition:
    return advance(snapshot(agent, [ask(), turn]), ports(tools=tools, clock=clock))  # type: ignore[arg-type]


# -- head UserTurn -------------------------------------------------------------------------------


def test_user_turn_calls_the_model_and_an_answer_without_calls_completes() -> None:
    llm = ScriptedLlm(llm_turn(text="It is sunny."))
    t = advance(snapshot(AGENT, [ask()]), ports(llm=llm))
    assert llm.calls == 1
    assert t.commit and t.kind == "llm"
    assert [turn.kind for turn in t.new_turns] == ["LlmTurn"]
    assert (t.head, t.state, t.status, t.response) == (
        "LlmTurn",
        State.COMPLETED,
        Status.COMPLETED,
        "It is sunny.",
    )
    assert t.usage.total_tokens == 12
    assert [e.type for e in t.events] == ["llm_called", "completed"]


def test_an_empty_final_answer_is_an_empty_response_not_none() -> None:
    t = advance(snapshot(AGENT, [ask()]), ports(llm=ScriptedLlm(llm_turn(text=None))))
    assert t.status == Status.COMPLETED
    assert t.response == ""


def test_user_turn_with_tool_calls_leaves_the_calls_for_the_next_step() -> None:
    tools = RecordingTools()
    llm = ScriptedLlm(llm_turn(("c1", "sync_a", "{}")))
    t = advance(snapshot(AGENT, [ask()]), ports(llm=llm, tools=tools))
    assert (t.head, t.state, t.status) == ("LlmTurn", State.TOOLS, Status.ACTIVE)
    assert t.response is None
    assert tools.runs == [], "tools run in the next step, not in the one that called the model"
    assert t.calls == [] and t.dispatch == []


def test_the_model_request_carries_the_agent_tools_and_the_session_version() -> None:
    llm = ScriptedLlm(llm_turn(text="ok"))
    advance(snapshot(AGENT, [ask("hi")]), ports(llm=llm))
    req = llm.requests[0]
    assert [t["function"]["name"] for t in req.tools] == [t.name for t in AGENT.tools]
    assert req.messages == [
        {"role": "system", "content": "You are a test."},
        {"role": "user", "content": "hi"},
    ]
    assert (req.session_id, req.version) == ("sess1", 1)


# -- head LlmTurn: running the calls ---------------------------------------------------------------


def test_run_sync_calls_run_inline_in_call_order_and_answer_in_one_user_turn() -> None:
    tools = RecordingTools({"sync_b": CallOutcome(state="completed", result={"b": 2})})
    t = run_tools(llm_turn(("c1", "sync_b", '{"x": 1}'), ("c2", "sync_a", "{}"), ("c3", "sync_b", "{}")), tools)
    assert tools.ran == ["c1", "c2", "c3"]
    assert tools.runs[0].arguments == {"x": 1}
    assert t.commit and t.kind == "tools"
    assert (t.head, t.state, t.status) == ("UserTurn", State.READY, Status.ACTIVE)
    [answer] = t.new_turns
    assert isinstance(answer, UserTurn)
    assert [(r.call_id, r.content) for r in answer.tool_responses] == [
        ("c1", {"b": 2}),
        ("c2", "sync_a ok"),
        ("c3", {"b": 2}),
    ]
    assert all(c.state == CallState.COMPLETED for c in t.calls)
    assert [c.field for c in t.calls] == ["1:0", "1:1", "1:2"], "batch is the LlmTurn's index, position the order"
    assert t.dispatch == [] and t.unfinished == []


def test_a_tool_failure_becomes_a_failed_call_and_the_step_goes_on() -> None:
    tools = RecordingTools({"sync_a": CallOutcome(state="failed", error="disk full", exit_status=1)})
    t = run_tools(llm_turn(("c1", "sync_a", "{}"), ("c2", "sync_b", "{}")), tools)
    assert tools.ran == ["c1", "c2"]
    assert [c.state for c in t.calls] == [CallState.FAILED, CallState.COMPLETED]
    assert t.calls[0].error == "disk full" and t.calls[0].exit_status == 1
    [answer] = t.new_turns
    assert isinstance(answer, UserTurn)
    assert answer.tool_responses[0].is_error and answer.tool_responses[0].content == "disk full"


def test_async_and_isolated_calls_are_dispatched_and_the_session_waits() -> None:
    tools = RecordingTools()
    t = run_tools(llm_turn(("c1", "async_t", '{"u": "x"}'), ("c2", "isolated_t", "{}"), ("c3", "sync_a", "{}")), tools)
    assert tools.ran == ["c3"], "only the runSync call runs in the step"
    assert [(c.call_id, c.disposition, c.state) for c in t.dispatch] == [
        ("c1", "runAsync", CallState.RUNNING),
        ("c2", "runIsolated", CallState.RUNNING),
    ]
    assert (t.head, t.state, t.status) == ("PartialUserTurn", State.WAITING, Status.ACTIVE)
    assert t.new_turns == [], "a PartialUserTurn is not appended to the transcript"
    assert [c.call_id for c in t.unfinished] == ["c1", "c2"]
    assert {e.type for e in t.events} == {"tool_dispatched", "tool_finished"}


def test_defer_creates_a_token_with_the_agent_deadline() -> None:
    clock = TickingClock(start=1000.0)
    t = run_tools(llm_turn(("c1", "defer_t", '{"amount": 5}')), clock=clock)
    [call] = t.calls
    assert call.state == CallState.DEFERRED
    assert call.token is not None and call.token.startswith("sess1.")
    assert call.reason == "a human approves"
    assert call.expires_at == call.created_at + AGENT.defer_timeout_seconds
    assert t.dispatch == []
    assert (t.head, t.state) == ("PartialUserTurn", State.WAITING)
    assert [e.type for e in t.events] == ["token_created"]
    assert t.events[0].data["reason"] == "a human approves"


def test_a_defer_rule_timeout_sets_the_deadline_and_tokens_differ_per_call() -> None:
    agent = make_agent(
        {"rules": [{"tool": "defer_t", "disposition": {"tag": "defer", "timeoutSeconds": 60}}]},
        executionMode="asynchronous",
    )
    t = run_tools(llm_turn(("c1", "defer_t", "{}"), ("c2", "defer_t", "{}")), agent=agent)
    assert all(c.expires_at == c.created_at + 60 for c in t.calls)
    assert t.calls[0].token != t.calls[1].token


def test_an_unknown_tool_becomes_a_failed_call_naming_the_tools() -> None:
    tools = RecordingTools()
    t = run_tools(llm_turn(("c1", "no_such_tool", "{}"), ("c2", "sync_a", "{}")), tools)
    assert tools.ran == ["c2"]
    failed = t.calls[0]
    assert failed.state == CallState.FAILED
    assert "no tool named 'no_such_tool'" in (failed.error or "")
    assert "sync_a" in (failed.error or "")
    assert t.head == "UserTurn", "a failed call is final: the model hears about it next"


@pytest.mark.parametrize(
    "raw,why",
    [
        ('{"city": "Par', "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('"Paris"', "must be a JSON object"),
    ],
)
def test_invalid_arguments_become_a_failed_call_without_running(raw: str, why: str) -> None:
    tools = RecordingTools()
    t = run_tools(llm_turn(("c1", "async_t", raw)), tools)
    [call] = t.calls
    assert tools.runs == [] and t.dispatch == []
    assert call.state == CallState.FAILED
    assert why in (call.error or "")
    assert call.raw_arguments == raw
    assert t.head == "UserTurn"


def test_empty_arguments_mean_an_empty_object() -> None:
    tools = RecordingTools()
    run_tools(llm_turn(("c1", "sync_a", "")), tools)
    assert tools.runs[0].arguments == {}


def test_sync_results_and_unfinished_async_calls_make_a_partial_turn() -> None:
    t = run_tools(llm_turn(("c1", "sync_a", "{}"), ("c2", "defer_t", "{}"), ("c3", "async_t", "{}")))
    assert [c.state for c in t.calls] == [CallState.COMPLETED, CallState.DEFERRED, CallState.RUNNING]
    assert t.head == "PartialUserTurn"
    assert [c.call_id for c in t.unfinished] == ["c2", "c3"]


def test_external_tool_calls_are_deferred_even_under_a_run_sync_default() -> None:
    tools = RecordingTools()
    t = run_tools(llm_turn(("c1", "external_t", "{}")), tools)
    assert tools.runs == []
    assert t.calls[0].disposition == "defer" and t.calls[0].token
    assert t.calls[0].reason == "external tool"


def test_synchronous_mode_runs_every_call_inline() -> None:
    agent = make_agent(executionMode="synchronous")
    tools = RecordingTools()
    t = run_tools(
        llm_turn(("c1", "async_t", "{}"), ("c2", "isolated_t", "{}"), ("c3", "defer_t", "{}")),
        tools,
        agent=agent,
    )
    assert tools.ran == ["c1", "c2", "c3"]
    assert t.head == "UserTurn" and t.dispatch == []


def test_a_head_llm_turn_without_calls_commits_nothing() -> None:
    t = advance(snapshot(AGENT, [ask(), llm_turn(text="done")]), ports())
    assert not t.commit
    assert t.status == Status.COMPLETED and t.response == "done"


# -- head PartialUserTurn ------------------------------------------------------------------------


def batch(*states: tuple[str, str, CallState]) -> list[TrackedCall]:
    return [
        TrackedCall(
            call_id=cid,
            tool=tool,
            batch=1,
            position=i,
            disposition="runAsync",
            state=state,
            result=f"{cid} result" if state == CallState.COMPLETED else None,
            error="it broke" if state == CallState.FAILED else None,
        )
        for i, (cid, tool, state) in enumerate(states)
    ]


def partial(calls: list[TrackedCall], *, steps: int = 2, step_limit: int = 40) -> object:
    turn = llm_turn(*[(c.call_id, c.tool, "{}") for c in sorted(calls, key=lambda c: c.position)])
    return snapshot(AGENT, [ask(), turn], partial=True, calls=calls, steps=steps, step_limit=step_limit)


def test_a_partial_turn_with_unfinished_calls_waits_without_committing() -> None:
    llm = ScriptedLlm()
    calls = batch(("c1", "async_t", CallState.COMPLETED), ("c2", "defer_t", CallState.DEFERRED))
    t = advance(partial(calls), ports(llm=llm))  # type: ignore[arg-type]
    assert (t.kind, t.commit, t.state) == ("wait", False, State.WAITING)
    assert t.new_turns == [] and llm.calls == 0


def test_a_finished_partial_turn_folds_into_a_user_turn_and_calls_the_model_in_the_same_step() -> None:
    llm = ScriptedLlm(llm_turn(text="All done."))
    calls = batch(
        ("c1", "async_t", CallState.COMPLETED),
        ("c2", "defer_t", CallState.FAILED),
        ("c3", "defer_t", CallState.EXPIRED),
    )
    t = advance(partial(calls), ports(llm=llm))  # type: ignore[arg-type]
    assert llm.calls == 1
    assert [turn.kind for turn in t.new_turns] == ["UserTurn", "LlmTurn"]
    folded = t.new_turns[0]
    assert isinstance(folded, UserTurn)
    assert [r.call_id for r in folded.tool_responses] == ["c1", "c2", "c3"]
    assert [r.is_error for r in folded.tool_responses] == [False, True, True]
    assert (t.status, t.response) == (Status.COMPLETED, "All done.")
    tool_msgs = [m for m in llm.requests[0].messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_msgs] == ["c1", "c2", "c3"]


def test_results_that_finished_out_of_order_go_back_in_call_order() -> None:
    llm = ScriptedLlm(llm_turn(text="ok"))
    calls = batch(
        ("c1", "async_t", CallState.COMPLETED),
        ("c2", "async_t", CallState.COMPLETED),
        ("c3", "async_t", CallState.COMPLETED),
    )
    for call, finished in zip(calls, (30.0, 20.0, 10.0), strict=True):
        call.finished_at = finished
    advance(partial(list(reversed(calls))), ports(llm=llm))  # type: ignore[arg-type]
    tool_msgs = [m for m in llm.requests[0].messages if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in tool_msgs] == [
        ("c1", "c1 result"),
        ("c2", "c2 result"),
        ("c3", "c3 result"),
    ]


def test_a_finished_partial_turn_whose_model_asks_again_goes_to_tools() -> None:
    llm = ScriptedLlm(llm_turn(("c9", "sync_a", "{}")))
    t = advance(partial(batch(("c1", "async_t", CallState.COMPLETED))), ports(llm=llm))  # type: ignore[arg-type]
    assert [turn.kind for turn in t.new_turns] == ["UserTurn", "LlmTurn"]
    assert (t.head, t.state, t.status) == ("LlmTurn", State.TOOLS, Status.ACTIVE)


# -- guards: step limit and model failures -------------------------------------------------------


def test_reaching_max_steps_fails_the_session_without_calling_the_model() -> None:
    llm = ScriptedLlm()
    t = advance(snapshot(AGENT, [ask()], steps=5, step_limit=5), ports(llm=llm))
    assert llm.calls == 0
    assert t.commit
    assert (t.state, t.status) == (State.FAILED, Status.FAILED)
    assert t.error is not None and t.error.code == "max_steps"
    assert "5 steps" in t.error.message and "resume" in t.error.message
    assert t.new_turns == []
    assert [e.type for e in t.events] == ["failed"]


def test_max_steps_after_a_finished_batch_still_commits_the_folded_results() -> None:
    llm = ScriptedLlm()
    t = advance(
        partial(batch(("c1", "async_t", CallState.COMPLETED)), steps=3, step_limit=3),  # type: ignore[arg-type]
        ports(llm=llm),
    )
    assert llm.calls == 0
    assert t.error is not None and t.error.code == "max_steps"
    assert [turn.kind for turn in t.new_turns] == ["UserTurn"]
    assert t.head == "UserTurn", "resuming later calls the model with the folded results"


def test_below_the_step_limit_the_model_is_called() -> None:
    llm = ScriptedLlm(llm_turn(text="ok"))
    t = advance(snapshot(AGENT, [ask()], steps=4, step_limit=5), ports(llm=llm))
    assert llm.calls == 1 and t.status == Status.COMPLETED


@pytest.mark.parametrize("transient", [True, False])
def test_a_model_failure_fails_the_session_and_keeps_the_error(transient: bool) -> None:
    llm = ScriptedLlm(LlmFailure("rate_limited" if transient else "auth", "401 bad key", transient=transient))
    t = advance(snapshot(AGENT, [ask()]), ports(llm=llm))
    assert t.commit
    assert (t.state, t.status, t.head) == (State.FAILED, Status.FAILED, "UserTurn")
    assert t.error is not None
    assert (t.error.code, t.error.message, t.error.transient) == (
        "rate_limited" if transient else "auth",
        "401 bad key",
        transient,
    )
    assert t.new_turns == []


def test_a_model_failure_after_a_finished_batch_still_commits_the_folded_results() -> None:
    llm = ScriptedLlm(LlmFailure("context_window", "too long", transient=False))
    t = advance(partial(batch(("c1", "async_t", CallState.COMPLETED))), ports(llm=llm))  # type: ignore[arg-type]
    assert llm.calls == 1
    assert [turn.kind for turn in t.new_turns] == ["UserTurn"]
    assert (t.head, t.status) == ("UserTurn", Status.FAILED)
    assert t.error is not None and t.error.code == "context_window"


# -- call ids the model got wrong ----------------------------------------------------------------


def test_duplicate_and_missing_call_ids_are_made_unique() -> None:
    llm = ScriptedLlm(
        llm_turn(("dup", "sync_a", "{}"), ("dup", "sync_b", "{}"), ("", "sync_a", "{}"), ("", "sync_b", "{}"))
    )
    t = advance(snapshot(AGENT, [ask()]), ports(llm=llm))
    [turn] = t.new_turns
    assert isinstance(turn, LlmTurn)
    ids = [c.id for c in turn.tool_calls]
    assert ids[0] == "dup"
    assert all(ids) and len(set(ids)) == 4
    assert [c.name for c in turn.tool_calls] == ["sync_a", "sync_b", "sync_a", "sync_b"]

    # the next step answers each of them exactly once
    tools = RecordingTools()
    t2 = advance(snapshot(AGENT, [ask(), turn]), ports(tools=tools))
    [answer] = t2.new_turns
    assert isinstance(answer, UserTurn)
    assert [r.call_id for r in answer.tool_responses] == ids
    assert tools.ran == ids


@pytest.mark.timeout(3)
def test_normalising_ids_ends_when_the_renamed_id_is_taken_too() -> None:
    llm = ScriptedLlm(llm_turn(("a", "sync_a", "{}"), ("a_2", "sync_a", "{}"), ("a", "sync_a", "{}")))
    t = advance(snapshot(AGENT, [ask()]), ports(llm=llm))
    [turn] = t.new_turns
    assert isinstance(turn, LlmTurn)
    assert len({c.id for c in turn.tool_calls}) == 3


def test_well_formed_ids_are_kept_as_the_model_sent_them() -> None:
    reply = llm_turn(ToolCall(id="call_abc", name="sync_a"), ToolCall(id="call_def", name="sync_b"))
    t = advance(snapshot(AGENT, [ask()]), ports(llm=ScriptedLlm(reply)))
    assert t.new_turns == [reply]


def test_a_grant_covers_the_tool_only_with_the_schema_it_was_given_for() -> None:
    """`approve --for-session` stores the tool's schema digest: a later call runs at once under
    `then` while the tool's schema is that one, and waits at the gate again once it is not."""
    from celery_agents.scheduler.machine import schema_digest

    gate = {"tag": "defer", "then": "runAsync", "reason": "a person approves"}
    agent = make_agent({"rules": [{"tool": "defer_t", "disposition": gate}]}, executionMode="asynchronous")
    tool = agent.tool("defer_t")
    assert tool is not None
    other = {"type": "object", "properties": {"amount": {"type": "number"}}}
    for grants, ran_as in (
        ({"defer_t": schema_digest(tool.parameters)}, (CallState.RUNNING, "runAsync", None)),
        ({"defer_t": schema_digest(other)}, (CallState.DEFERRED, "defer", "runAsync")),
        ({}, (CallState.DEFERRED, "defer", "runAsync")),
    ):
        snap = snapshot(agent, [ask(), llm_turn(("c1", "defer_t", "{}"))])
        snap.header.grants = grants
        (call,) = advance(snap, ports()).calls
        assert (call.state, call.disposition, call.then) == ran_as, grants
