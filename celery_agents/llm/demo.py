"""The offline demo model, `demo/<anything>`: deterministic, no network, served through litellm.

It answers a weather question by calling the demo tools it is offered (`get_weather`,
`get_forecast`, and `book_table` when asked to book), then writes its answer from their results.
With no tools it answers at once, which makes it the benchmark's instant model; asked to "count to
N" (N up to 2000) it counts, an answer of about N tokens (the benchmark's long answer).
"""

from __future__ import annotations

import json
import re
from typing import Any

PROVIDER = "demo"

_CITY = re.compile(r"\b(?:in|at|for)\s+([A-Z][\w\u00C0-\u017F'-]*(?:\s+[A-Z][\w\u00C0-\u017F'-]*)*)")
_WEATHER = re.compile(r"weather|forecast|temperature|rain|sunny|umbrella|cold|warm", re.IGNORECASE)
_BOOK = re.compile(r"\b(book|reserve|table)\b", re.IGNORECASE)
_COUNT = re.compile(r"\bcount to (\d{1,4})\b", re.IGNORECASE)
#: the longest count the demo model writes out
COUNT_LIMIT = 2000


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _parse(content: str) -> Any:
    try:
        return json.loads(content)
    except (json.JSONDecodeError, TypeError):
        return content


def _describe(name: str, content: str) -> str:
    value = _parse(content)
    if content.startswith("Error") or content.startswith("No result arrived"):
        return f"I could not use {name}: {content}"
    if name == "get_weather" and isinstance(value, dict):
        return f"Right now in {value.get('city')} it is {value.get('temperature_c')} °C and {value.get('conditions')}."
    if name == "get_forecast" and isinstance(value, dict):
        days = ", ".join(
            f"{d.get('day')} {d.get('high_c')}/{d.get('low_c')} °C {d.get('conditions')}" for d in value.get("days", [])
        )
        return f"Forecast for {value.get('city')}: {days}."
    if name == "book_table":
        text = value if isinstance(value, str) else json.dumps(value)
        return f"About the table: {text}"
    return f"{name} returned: {content}"


def demo_reply(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The demo model's answer to a conversation: text, reasoning, tool calls, usage."""
    offered = {t["function"]["name"] for t in tools or [] if t.get("type") == "function"}
    turn_no = sum(1 for m in messages if m.get("role") == "assistant")
    last = messages[-1] if messages else {"role": "user", "content": ""}
    prompt_tokens = sum(len(json.dumps(m)) for m in messages) // 4
    if last.get("role") == "tool":
        text = _summary(messages)
        return {
            "content": text,
            "reasoning": "All the tool results are in; I summarise them for the user.",
            "tool_calls": [],
            "usage": (prompt_tokens, len(text) // 4 + 1),
        }
    query = _text_of(last.get("content"))
    match = _CITY.search(query)
    city = match.group(1) if match else None
    calls = _calls_for(query, city, offered)
    if calls:
        reasoning = (
            f"The user asks about {city or 'a booking'}. I will call "
            + ", ".join(c["name"] for c in calls)
            + " and answer from their results."
        )
        return {
            "content": None,
            "reasoning": reasoning,
            "tool_calls": [
                {"id": f"call_{turn_no}_{i}", "name": c["name"], "arguments": json.dumps(c["arguments"])}
                for i, c in enumerate(calls)
            ],
            "usage": (prompt_tokens, 12 * len(calls)),
        }
    counted = _COUNT.search(query)
    if counted and 0 < int(counted.group(1)) <= COUNT_LIMIT:
        text = " ".join(str(i) for i in range(1, int(counted.group(1)) + 1)) + "."
    elif _WEATHER.search(query):
        text = "I can look up the weather when you name a city, for example: What is the weather in Paris?"
    else:
        text = f"(offline demo model) You said: {query.strip()[:500]}"
    return {"content": text, "reasoning": None, "tool_calls": [], "usage": (prompt_tokens, len(text) // 4 + 1)}


def _summary(messages: list[dict[str, Any]]) -> str:
    """The answer from the tool results that end the conversation, in call order."""
    names: dict[str, str] = {}
    for m in reversed(messages):
        if m.get("role") == "assistant":
            names = {c["id"]: c["function"]["name"] for c in m.get("tool_calls") or []}
            break
    tail = []
    for m in reversed(messages):
        if m.get("role") != "tool":
            break
        tail.append(m)
    return " ".join(
        _describe(names.get(m["tool_call_id"], "a tool"), _text_of(m.get("content"))) for m in reversed(tail)
    )


def _calls_for(query: str, city: str | None, offered: set[str]) -> list[dict[str, Any]]:
    """The demo tools a question asks for, among those offered."""
    calls: list[dict[str, Any]] = []
    if _WEATHER.search(query) and city:
        if "get_weather" in offered:
            calls.append({"name": "get_weather", "arguments": {"city": city}})
        if "get_forecast" in offered:
            calls.append({"name": "get_forecast", "arguments": {"city": city, "days": 3}})
    if _BOOK.search(query) and "book_table" in offered:
        arguments = {"city": city or "Paris", "when": "tomorrow 12:30", "seats": 2, "terrace": True}
        calls.append({"name": "book_table", "arguments": arguments})
    return calls
