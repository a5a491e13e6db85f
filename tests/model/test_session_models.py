"""Turns, tracked calls and session views survive JSON exactly (they live in Redis as JSON)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from celery_agents.model import (
    FINAL_STATES,
    CallState,
    CompletionOutcome,
    ErrorInfo,
    LlmTurn,
    Media,
    PendingCall,
    SessionHeader,
    SessionView,
    State,
    StoredTurn,
    ToolCall,
    ToolResponse,
    TrackedCall,
    Usage,
    UserQuery,
    UserTurn,
)

TURN = TypeAdapter(StoredTurn)
STORED = TypeAdapter(StoredTurn)


def tracked(**extra: Any) -> TrackedCall:
    data: dict[str, Any] = {
        "call_id": "call_1",
        "tool": "lookup",
        "arguments": {"q": "x"},
        "raw_arguments": '{"q": "x"}',
        "batch": 1,
        "position": 0,
        "disposition": "defer",
    }
    data.update(extra)
    return TrackedCall(**data)


TURNS: list[Any] = [
    UserTurn(
        query=UserQuery(text="hello", media=[Media(mime_type="image/png", data_base64="aGk=", filename="a.png")]),
        at=1.5,
    ),
    UserTurn(
        tool_responses=[
            ToolResponse(call_id="c1", tool="t", content={"temp": 21}),
            ToolResponse(
                call_id="c2",
                tool="t",
                content="boom",
                is_error=True,
                media=[Media(mime_type="image/jpeg", data_base64="eA==")],
            ),
        ]
    ),
    LlmTurn(
        text="let me check",
        reasoning="I should look it up",
        thinking_blocks=[{"type": "thinking", "thinking": "hm", "signature": "sig=="}],
        tool_calls=[ToolCall(id="c1", name="t", arguments='{"a": 1}'), ToolCall(id="c2", name="t")],
        usage=Usage(prompt_tokens=10, completion_tokens=5, total_tokens=15, reasoning_tokens=3, cost=0.002),
        model="openai/gpt-4o-mini",
        finish_reason="tool_calls",
        at=2.0,
        duration_ms=12.5,
    ),
    LlmTurn(text="done", finish_reason="stop"),
]


@pytest.mark.parametrize("turn", TURNS, ids=lambda t: t.kind)
def test_every_turn_round_trips_through_the_discriminated_union(turn: Any) -> None:
    raw = turn.model_dump_json()
    back = TURN.validate_json(raw)
    assert type(back) is type(turn)
    assert back == turn
    assert back.model_dump_json() == raw


@pytest.mark.parametrize("turn", TURNS[:4], ids=lambda t: t.kind)
def test_stored_turns_round_trip_as_the_store_writes_them(turn: Any) -> None:
    raw = turn.model_dump_json(exclude_none=True)
    assert STORED.validate_json(raw) == turn


def test_the_kind_picks_the_turn_type() -> None:
    assert isinstance(TURN.validate_python({"kind": "LlmTurn", "text": "x"}), LlmTurn)
    assert isinstance(TURN.validate_python({"kind": "UserTurn"}), UserTurn)
    for never_stored in ("PartialUserTurn", "RobotTurn"):
        with pytest.raises(ValidationError):
            TURN.validate_python({"kind": never_stored})
    with pytest.raises(ValidationError):
        STORED.validate_python({"kind": "PartialUserTurn"})


def test_thinking_blocks_survive_byte_for_byte() -> None:
    blocks = [
        {"type": "thinking", "thinking": "step 1\nstep 2", "signature": "EqQBCgIYAhIM+/=="},
        {"type": "redacted_thinking", "data": "opaque"},
    ]
    back = TURN.validate_json(LlmTurn(thinking_blocks=blocks).model_dump_json())
    assert isinstance(back, LlmTurn)
    assert back.thinking_blocks == blocks


def test_tracked_call_round_trips_with_every_field() -> None:
    call = tracked(
        state=CallState.DEFERRED,
        reason="approval",
        token="sid.secret",
        attempts=2,
        created_at=1.0,
        started_at=2.0,
        finished_at=3.0,
        expires_at=4.0,
        duration_ms=5.0,
        exit_status=1,
        completed_by="ops",
        error="e",
        result={"nested": [1, {"x": None}]},
        meta={"media": []},
    )
    back = TrackedCall.model_validate_json(call.model_dump_json())
    assert back == call
    assert TrackedCall.model_validate_json(call.model_dump_json(exclude_defaults=True)) == call


def test_tracked_call_field_and_idempotency_key() -> None:
    call = tracked(batch=3, position=2)
    assert call.field == "3:2"
    assert call.idempotency_key("sid") == "sid:3:call_1"
    assert call.digest() == tracked(batch=9, position=0).digest(), "the digest binds tool and arguments only"
    assert call.digest() != tracked(arguments={"q": "y"}).digest()


def test_final_states() -> None:
    assert {"completed", "failed", "cancelled", "expired"} == FINAL_STATES
    assert [s.value for s in CallState if not s.final] == ["ready", "running", "deferred"]


def test_usage_adds_up_and_keeps_unknown_cost_unknown() -> None:
    a = Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3, reasoning_tokens=1, cached_tokens=1)
    total = a + Usage(prompt_tokens=10, completion_tokens=20, total_tokens=30, cost=0.5)
    assert (total.prompt_tokens, total.completion_tokens, total.total_tokens) == (11, 22, 33)
    assert total.cost == 0.5
    assert (a + a).cost is None


def test_session_header_and_views_round_trip() -> None:
    header = SessionHeader(
        session_id="s",
        agent_slug="a",
        agent_hash="h",
        execution_mode="asynchronous",
        version=3,
        state=State.WAITING,
        drive="auto",
        head="PartialUserTurn",
        steps=2,
        usage=Usage(total_tokens=5),
        error=ErrorInfo(code="x", message="y", transient=True),
        response="r",
    )
    assert SessionHeader.model_validate_json(header.model_dump_json()) == header
    pending = PendingCall(
        session_id="s",
        call_id="c",
        tool="t",
        arguments={"a": 1},
        disposition="defer",
        reason="why",
        state="deferred",
        token="s.tok",
        created_at=1.0,
        expires_at=2.0,
    )
    view = SessionView(
        session_id="s", state=State.WAITING, head="PartialUserTurn", version=3, steps=2, pending=[pending]
    )
    assert SessionView.model_validate_json(view.model_dump_json()) == view
    outcome = CompletionOutcome(token="s.tok", session_id="s", call_id="c", remaining=0, woken=True)
    assert CompletionOutcome.model_validate_json(outcome.model_dump_json()) == outcome


def test_session_view_json_has_the_contract_keys() -> None:
    view = SessionView(session_id="s", state=State.READY, head="UserTurn", version=1, steps=0)
    data = view.to_json()
    for key in ("session_id", "state", "head", "version", "steps", "pending", "response", "error"):
        assert key in data
    assert data["state"] == "ready" and data["pending"] == [] and data["response"] is None
    assert "turns" not in data and "calls" not in data
    json.dumps(data)


def test_build_schemas_leaves_no_model_to_build_on_first_use() -> None:
    import pydantic

    from celery_agents.model import agent, build_schemas, calls, session, turns

    build_schemas()
    unbuilt = [
        name
        for module in (agent, calls, session, turns)
        for name, value in vars(module).items()
        if isinstance(value, type)
        and value.__module__ == module.__name__
        and issubclass(value, pydantic.BaseModel)
        and not value.__pydantic_complete__
    ]
    assert unbuilt == []


def test_a_stored_call_keeps_the_text_of_its_arguments_only_when_it_says_more() -> None:
    """The model's text of arguments that parsed is their JSON again (its turn holds the exact
    text); text that did not parse is kept as it came."""
    parsed = tracked(raw_arguments='{"q":   "x"}')
    stored = json.loads(parsed.stored_json())
    assert "raw_arguments" not in stored and stored["arguments"] == {"q": "x"}
    back = TrackedCall.model_validate_json(parsed.stored_json())
    assert json.loads(back.raw_arguments) == {"q": "x"} and back.arguments == {"q": "x"}
    broken = tracked(arguments=None, raw_arguments='{"q": "x', state="failed", error="not valid JSON")
    assert TrackedCall.model_validate_json(broken.stored_json()).raw_arguments == '{"q": "x'
