"""The offline demo model, through litellm: deterministic weather answers from the demo tools."""

from __future__ import annotations

from celery_agents.llm import LitellmPort
from celery_agents.llm.demo import demo_reply
from celery_agents.scheduler import LlmRequest
from celery_agents.tools.resolve import parse_agent

TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("get_weather", "get_forecast", "book_table")
]


def test_a_weather_question_calls_the_weather_tools() -> None:
    reply = demo_reply([{"role": "user", "content": "What is the weather in Paris?"}], TOOLS)
    assert [c["name"] for c in reply["tool_calls"]] == ["get_weather", "get_forecast"]
    assert reply["reasoning"]


def test_asking_to_book_adds_the_deferred_booking() -> None:
    reply = demo_reply([{"role": "user", "content": "Weather in Lyon? Book a table."}], TOOLS)
    assert [c["name"] for c in reply["tool_calls"]] == ["get_weather", "get_forecast", "book_table"]


def test_results_become_an_answer_and_the_same_input_gives_the_same_output() -> None:
    first = demo_reply([{"role": "user", "content": "What is the weather in Paris?"}], TOOLS)
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in first["tool_calls"]
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_0_0",
            "content": '{"city": "Paris", "temperature_c": 12, "conditions": "windy"}',
        },
        {"role": "tool", "tool_call_id": "call_0_1", "content": "Error: the forecast service is down"},
    ]
    answer = demo_reply(messages, TOOLS)
    assert answer["tool_calls"] == []
    assert "12 °C and windy" in answer["content"] and "could not use get_forecast" in answer["content"]
    assert demo_reply(messages, TOOLS) == answer


def test_without_tools_it_answers_at_once_through_litellm() -> None:
    agent = parse_agent({"slug": "d", "model": "demo/plain"})
    turn = LitellmPort().complete(LlmRequest(agent=agent, messages=[{"role": "user", "content": "hello"}], tools=[]))
    assert turn.text == "(offline demo model) You said: hello"
    assert turn.model == "demo/plain" and turn.usage.total_tokens > 0 and turn.usage.cost == 0.0
