"""Model calls of OpenAI-compatible endpoints go through litellm's own HTTP handler, not the OpenAI
SDK (`llm/adapter.py`, "the HTTP route"): the session sees exactly what the SDK route gave it.

Each case asks the local server the same scripted answer once per route and compares what a
session keeps of it: the turn (text, reasoning, tool calls, usage, cost, model, finish reason), the
pieces streamed to the live output, and a failure's code, retry class, `Retry-After` and message
(a failure of the transport itself, a timeout or a refused connection, is worded by each route's
transport: its code and retry class are the same).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from celery_agents.llm import LitellmPort, RetryPolicy
from celery_agents.llm.adapter import HTTP_ROUTE_VARIABLE, ensure_litellm
from celery_agents.scheduler import LlmFailure, LlmRequest
from celery_agents.tools.resolve import parse_agent
from tests.llm.test_streaming import Recorder
from tests.support.llm_server import LlmServer, Reply, error, text

ROUTES = {"sdk": "false", "http": "true"}


@pytest.fixture
def route(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    ensure_litellm()

    def use(name: str) -> None:
        monkeypatch.setenv(HTTP_ROUTE_VARIABLE, ROUTES[name])

    yield use


def _request(server: LlmServer, reply: Reply, live: Recorder | None, **agent: Any) -> LlmRequest:
    spec = parse_agent({"slug": "t", "model": f"openai/{server.scenario([reply])}", "apiBase": server.url, **agent})
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    return LlmRequest(agent=spec, messages=[{"role": "user", "content": "hi"}], tools=tools, live=live)


def _seen(server: LlmServer, make: Callable[[], Reply], streamed: bool, timeout: float = 10) -> dict[str, Any]:
    """What a session keeps of one call: its turn (the scenario's name, which differs per call,
    taken out of the model), or its failure; and the pieces streamed."""
    live = Recorder() if streamed else None
    req = _request(server, make(), live)
    port = LitellmPort(RetryPolicy(attempts=1, timeout=timeout))
    scenario = req.agent.model.removeprefix("openai/")
    out: dict[str, Any] = {}
    try:
        turn = port.complete(req)
        out["turn"] = turn.model_dump(exclude={"at", "duration_ms"})
        out["turn"]["model"] = turn.model.replace(scenario, "<scenario>")
    except LlmFailure as exc:
        out["failure"] = (exc.code, exc.transient, exc.retry_after, exc.message.replace(scenario, "<scenario>"))
    if live is not None:
        out["pieces"] = (live.joined("reasoning"), live.joined("text"))
    return out


ANSWERS: dict[str, Callable[[], Reply]] = {
    "text": lambda: text("It is sunny in Paris today, 21 °C.", usage=(40, 12)),
    "reasoning, text and two tool calls": lambda: Reply(
        content="Let me look that up.",
        reasoning="The user wants the weather; I call the tool.",
        tool_calls=[("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_weather", {"city": "Lyon"}, "c-9")],
        usage=(120, 30),
        reasoning_tokens=12,
    ),
    "a tool call whose arguments are not JSON": lambda: Reply(
        tool_calls=[("get_weather", {})], raw_arguments={0: '{"city": "Par'}
    ),
    "no text at all": lambda: Reply(content=None),
    "reasoning with no reasoning tokens reported": lambda: text("Sunny.", reasoning="Let me think.", usage=(20, 9)),
    "429 with Retry-After": lambda: error(429, "slow down", headers={"retry-after": "7"}),
    "429": lambda: error(429, "slow down"),
    "500": lambda: error(500, "boom"),
    "503": lambda: error(503, "overloaded"),
    "400": lambda: error(400, "bad tools"),
    "401": lambda: error(401, "who are you"),
    "404": lambda: error(404, "no such model"),
    "400 context window": lambda: error(400, "This model's maximum context length is 8192 tokens"),
}


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", list(ANSWERS))
def test_the_http_route_gives_the_session_what_the_sdk_route_gave(
    llm_server: LlmServer, route: Callable[[str], None], case: str, streamed: bool
) -> None:
    seen = {}
    for name in ROUTES:
        route(name)
        seen[name] = _seen(llm_server, ANSWERS[case], streamed)
    assert seen["http"] == seen["sdk"]
    assert seen["sdk"].get("turn") or seen["sdk"].get("failure")


def test_a_model_that_does_not_answer_in_time_fails_alike_on_both_routes(
    llm_server: LlmServer, route: Callable[[str], None]
) -> None:
    """Same code and retry class; the wording is the transport's (and carries the time taken)."""
    seen = {}
    for name in ROUTES:
        route(name)
        seen[name] = _seen(llm_server, lambda: text("late", delay=2.0), streamed=False, timeout=0.5)["failure"][:3]
    assert seen["http"] == seen["sdk"] == ("timeout", True, None)


def test_a_closed_port_fails_alike_on_both_routes(route: Callable[[str], None]) -> None:
    """Same code and retry class."""
    from tests.support.redis_server import free_port

    spec = parse_agent({"slug": "t", "model": "openai/none", "apiBase": f"http://127.0.0.1:{free_port()}/v1"})
    req = LlmRequest(agent=spec, messages=[{"role": "user", "content": "hi"}], tools=[])
    seen = {}
    for name in ROUTES:
        route(name)
        with pytest.raises(LlmFailure) as info:
            LitellmPort(RetryPolicy(attempts=1, timeout=5)).complete(req)
        seen[name] = (info.value.code, info.value.transient, info.value.retry_after)
    # litellm reports a refused connection as a server error on both routes; the wording is the
    # transport's ("Connection error." from the SDK, the connector's reason from aiohttp).
    assert seen["http"] == seen["sdk"] == ("server_error", True, None)


def test_a_tool_call_that_continues_a_conversation_is_sent_alike(
    llm_server: LlmServer, route: Callable[[str], None]
) -> None:
    """The request, not only the answer: an assistant turn with tool calls and its tool result,
    model params, a system message, all reach the server as the same JSON on both routes."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"sky": "clear"}'},
    ]
    sent = {}
    for name in ROUTES:
        route(name)
        req = _request(llm_server, text("ok"), None, modelParams={"temperature": 0.2, "max_tokens": 50, "seed": 3})
        req = dataclasses.replace(req, messages=messages)
        LitellmPort(RetryPolicy(attempts=1, timeout=10)).complete(req)
        body = dict(llm_server.requests[req.agent.model.removeprefix("openai/")][-1])
        body.pop("model")
        sent[name] = body
    assert sent["http"] == sent["sdk"]


def test_a_priced_model_costs_the_same_on_both_routes(route: Callable[[str], None]) -> None:
    # a server of its own: the model's name is the scenario's, which other tests count requests of
    server = LlmServer().start()
    spec = parse_agent({"slug": "t", "model": "openai/gpt-4o-mini", "apiBase": server.url})
    req = LlmRequest(agent=spec, messages=[{"role": "user", "content": "hi"}], tools=[])
    usage = {}
    try:
        for name in ROUTES:
            route(name)
            usage[name] = LitellmPort(RetryPolicy(attempts=1, timeout=10)).complete(req).usage
    finally:
        server.stop()
    assert usage["http"] == usage["sdk"]
    assert usage["sdk"].cost is not None and usage["sdk"].cost > 0


def test_an_organization_in_model_params_is_sent_on_both_routes(
    llm_server: LlmServer, route: Callable[[str], None]
) -> None:
    """The OpenAI SDK sends `organization` as a header; litellm's HTTP handler drops it, so the
    adapter sends it as that header itself."""
    req = _request(llm_server, text("ok"), None, modelParams={"organization": "org-7", "extra_headers": {"X-A": "1"}})
    for name in ROUTES:
        route(name)
        LitellmPort(RetryPolicy(attempts=1, timeout=10)).complete(req)
    sent = llm_server.requests[req.agent.model.removeprefix("openai/")]
    assert [r["_organization"] for r in sent] == ["org-7", "org-7"]
