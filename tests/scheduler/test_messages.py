"""Building the OpenAI-shaped messages a model call sends, from the session's turns."""

from __future__ import annotations

import json
from typing import Any

import pytest

from celery_agents.model import CallState, LlmTurn, Media, ToolCall, ToolResponse, TrackedCall, UserQuery, UserTurn
from celery_agents.scheduler import build_messages, response_for, responses_turn, tool_content
from celery_agents.tools.resolve import parse_agent
from tests.scheduler.fakes import ask, llm_turn, make_agent

AGENT = make_agent()
NO_PROMPT = parse_agent({"slug": "a", "model": "m"})


def tool_messages(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(m["tool_call_id"], m["content"]) for m in messages if m["role"] == "tool"]


def answered(*responses: ToolResponse) -> UserTurn:
    return UserTurn(tool_responses=list(responses))


def test_the_system_prompt_comes_first() -> None:
    messages = build_messages(AGENT, [ask("hi")])
    assert messages == [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "hi"}]


def test_a_system_prompt_given_as_lines_is_one_message() -> None:
    agent = parse_agent({"slug": "a", "model": "m", "systemPrompt": ["one", "two"]})
    assert build_messages(agent, [ask("hi")])[0] == {"role": "system", "content": "one\ntwo"}


def test_no_system_prompt_no_system_message() -> None:
    assert build_messages(NO_PROMPT, [ask("hi")]) == [{"role": "user", "content": "hi"}]


def test_a_whole_conversation_in_order() -> None:
    turns = [
        ask("weather?"),
        llm_turn(("c1", "get", '{"city": "Paris"}'), text="checking"),
        answered(ToolResponse(call_id="c1", tool="get", content={"temp": 21})),
        llm_turn(text="It is 21."),
        UserTurn(query=UserQuery(text="thanks")),
    ]
    assert build_messages(NO_PROMPT, turns) == [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "checking",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "It is 21."},
        {"role": "user", "content": "thanks"},
    ]


def test_one_tool_message_per_call_in_the_model_call_order() -> None:
    turns = [
        ask(),
        llm_turn(("c1", "a", "{}"), ("c2", "b", "{}"), ("c3", "c", "{}")),
        # finished in another order than asked
        answered(
            ToolResponse(call_id="c3", tool="c", content="three"),
            ToolResponse(call_id="c1", tool="a", content="one"),
            ToolResponse(call_id="c2", tool="b", content="two"),
        ),
    ]
    assert tool_messages(build_messages(NO_PROMPT, turns)) == [("c1", "one"), ("c2", "two"), ("c3", "three")]


def test_a_call_answered_twice_gets_one_message_and_a_stray_answer_none() -> None:
    turns = [
        ask(),
        llm_turn(("c1", "a", "{}")),
        answered(
            ToolResponse(call_id="c1", tool="a", content="first"),
            ToolResponse(call_id="c1", tool="a", content="again"),
            ToolResponse(call_id="zz", tool="a", content="stray"),
        ),
    ]
    msgs = tool_messages(build_messages(NO_PROMPT, turns))
    assert [cid for cid, _ in msgs] == ["c1"]


def test_a_call_without_an_answer_is_told_so() -> None:
    turns = [
        ask(),
        llm_turn(("c1", "a", "{}"), ("c2", "lookup", "{}")),
        answered(ToolResponse(call_id="c1", tool="a", content="one")),
    ]
    msgs = tool_messages(build_messages(NO_PROMPT, turns))
    assert [cid for cid, _ in msgs] == ["c1", "c2"]
    assert msgs[1][1].startswith("Error:") and "lookup" in msgs[1][1]


def test_tool_content_strings_as_they_are_json_values_encoded() -> None:
    assert tool_content(ToolResponse(call_id="c", tool="t", content="plain text")) == "plain text"
    assert json.loads(tool_content(ToolResponse(call_id="c", tool="t", content={"a": [1, "é"]}))) == {"a": [1, "é"]}
    assert "é" in tool_content(ToolResponse(call_id="c", tool="t", content={"a": "é"}))
    assert tool_content(ToolResponse(call_id="c", tool="t", content=None)) == ""
    assert tool_content(ToolResponse(call_id="c", tool="t", content=0)) == "0"


def test_errors_are_marked_as_errors_once() -> None:
    assert tool_content(ToolResponse(call_id="c", tool="t", content="disk full", is_error=True)) == "Error: disk full"
    assert tool_content(ToolResponse(call_id="c", tool="t", content="Error: x", is_error=True)) == "Error: x"


def call(state: CallState, **extra: Any) -> TrackedCall:
    return TrackedCall(call_id="c1", tool="approve", batch=1, position=0, disposition="defer", state=state, **extra)


def test_what_the_model_is_told_about_each_final_state() -> None:
    done = response_for(call(CallState.COMPLETED, result={"ok": True}))
    assert (done.content, done.is_error) == ({"ok": True}, False)
    failed = response_for(call(CallState.FAILED, error="exit 2: no such city"))
    assert (failed.content, failed.is_error) == ("exit 2: no such city", True)
    expired = response_for(call(CallState.EXPIRED, reason="a human approves"))
    assert expired.is_error
    assert "expired" in expired.content and "a human approves" in expired.content
    cancelled = response_for(call(CallState.CANCELLED))
    assert cancelled.is_error and "cancelled" in cancelled.content
    assert tool_content(cancelled).startswith("Error: ")


def test_a_failed_call_without_error_text_still_says_it_failed() -> None:
    r = response_for(call(CallState.FAILED))
    assert r.is_error and r.content


def test_responses_turn_orders_by_call_position() -> None:
    calls = [
        call(CallState.COMPLETED, result=p).model_copy(update={"call_id": f"c{p}", "position": p}) for p in (2, 0, 1)
    ]
    turn = responses_turn(calls, now=5.0)
    assert [r.call_id for r in turn.tool_responses] == ["c0", "c1", "c2"]
    assert turn.at == 5.0 and turn.query is None


def test_thinking_blocks_go_back_verbatim() -> None:
    blocks = [
        {"type": "thinking", "thinking": "Paris first", "signature": "c2lnbmF0dXJl"},
        {"type": "redacted_thinking", "data": "opaque=="},
    ]
    turn = LlmTurn(
        text=None,
        reasoning="Paris first",
        thinking_blocks=blocks,
        tool_calls=[ToolCall(id="c1", name="get", arguments="{}")],
    )
    msgs = build_messages(NO_PROMPT, [ask(), turn, answered(ToolResponse(call_id="c1", tool="get", content="21"))])
    assistant = msgs[1]
    assert assistant["thinking_blocks"] == blocks
    assert "reasoning_content" not in assistant, "the blocks carry the reasoning already"


def test_reasoning_without_blocks_goes_back_as_reasoning_content() -> None:
    turn = LlmTurn(text="hi", reasoning="the user greets")
    msgs = build_messages(NO_PROMPT, [ask(), turn])
    assert msgs[1] == {"role": "assistant", "content": "hi", "reasoning_content": "the user greets"}


def test_query_media_become_content_parts() -> None:
    query = UserQuery(
        text="what is this?",
        media=[
            Media(mime_type="image/png", data_base64="iVBO"),
            Media(mime_type="application/pdf", data_base64="JVBE", filename="doc.pdf"),
        ],
    )
    [msg] = build_messages(NO_PROMPT, [UserTurn(query=query)])
    assert msg == {
        "role": "user",
        "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
            {
                "type": "file",
                "file": {"file_data": "data:application/pdf;base64,JVBE", "filename": "doc.pdf"},
            },
        ],
    }


def test_media_only_query_has_no_empty_text_part() -> None:
    [msg] = build_messages(
        NO_PROMPT, [UserTurn(query=UserQuery(media=[Media(mime_type="image/gif", data_base64="R0")]))]
    )
    assert msg["content"] == [{"type": "image_url", "image_url": {"url": "data:image/gif;base64,R0"}}]


def test_images_a_tool_returned_follow_the_tool_messages() -> None:
    turns = [
        ask(),
        llm_turn(("c1", "shot", "{}"), ("c2", "shot", "{}")),
        answered(
            ToolResponse(
                call_id="c1",
                tool="shot",
                content="took it",
                media=[Media(mime_type="image/png", data_base64="AAAA")],
            ),
            ToolResponse(call_id="c2", tool="shot", content="none"),
        ),
    ]
    msgs = build_messages(NO_PROMPT, turns)
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool", "user"]
    parts = msgs[-1]["content"]
    assert {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}} in parts


@pytest.mark.parametrize("n", [1, 5])
def test_every_assistant_call_is_answered_before_the_next_assistant_message(n: int) -> None:
    turns: list[UserTurn | LlmTurn] = [ask()]
    for i in range(n):
        turns.append(llm_turn((f"c{i}a", "t", "{}"), (f"c{i}b", "t", "{}")))
        turns.append(
            answered(
                ToolResponse(call_id=f"c{i}b", tool="t", content="b"),
                ToolResponse(call_id=f"c{i}a", tool="t", content="a"),
            )
        )
    msgs = build_messages(NO_PROMPT, turns)
    expected: list[str] = []
    for i in range(n):
        expected += ["assistant", f"c{i}a", f"c{i}b"]
    got = [m["tool_call_id"] if m["role"] == "tool" else m["role"] for m in msgs[1:]]
    assert got == expected


def test_a_file_a_tool_returned_is_sent_as_a_file_part() -> None:
    pdf = Media(mime_type="application/pdf", data_base64="JVBE", filename="report.pdf")
    turns = [
        ask(),
        llm_turn(("c1", "report", "{}")),
        answered(ToolResponse(call_id="c1", tool="report", content="attached", media=[pdf])),
    ]
    parts = build_messages(NO_PROMPT, turns)[-1]["content"]
    assert {
        "type": "file",
        "file": {"file_data": "data:application/pdf;base64,JVBE", "filename": "report.pdf"},
    } in parts
