"""The litellm adapter against a real OpenAI-compatible HTTP server: mapping, retries, errors,
fallback models, keys."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest

from celery_agents.llm import LitellmPort, RetryPolicy
from celery_agents.llm.errors import classify
from celery_agents.scheduler import LlmFailure, LlmRequest
from celery_agents.tools.resolve import parse_agent
from tests.support.llm_server import LlmServer, Reply, calls, error, text


class Sleeps:
    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


def port(attempts: int = 4) -> tuple[LitellmPort, Sleeps]:
    sleeps = Sleeps()
    return LitellmPort(RetryPolicy(attempts=attempts, backoff=0.01, max_backoff=60, timeout=10), sleep=sleeps), sleeps


def request(server: LlmServer, replies: list[Any], **agent: Any) -> tuple[LlmRequest, str]:
    scenario = server.scenario(replies)
    spec = parse_agent({"slug": "t", "model": f"openai/{scenario}", "apiBase": server.url, **agent})
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    return LlmRequest(agent=spec, messages=[{"role": "user", "content": "hi"}], tools=tools), scenario


def test_text_reasoning_tool_calls_and_usage_are_mapped(llm_server: LlmServer) -> None:
    reply = calls(
        ("get_weather", {"city": "Paris"}), reasoning="thinking it over", usage=(120, 30), reasoning_tokens=12
    )
    reply.content = "let me look"
    req, _ = request(llm_server, [reply])
    turn = port()[0].complete(req)
    assert turn.text == "let me look"
    assert turn.reasoning == "thinking it over"
    assert [(c.id, c.name, json.loads(c.arguments)) for c in turn.tool_calls] == [
        ("call_0_0", "get_weather", {"city": "Paris"})
    ]
    assert (turn.usage.prompt_tokens, turn.usage.completion_tokens, turn.usage.total_tokens) == (120, 30, 150)
    assert turn.usage.reasoning_tokens == 12
    assert turn.finish_reason == "tool_calls"


def test_the_request_carries_messages_tools_and_model_params(llm_server: LlmServer) -> None:
    req, scenario = request(llm_server, [text("ok")], modelParams={"temperature": 0.2})
    port()[0].complete(req)
    sent = llm_server.requests[scenario][-1]
    assert sent["messages"] == [{"role": "user", "content": "hi"}]
    assert sent["tools"][0]["function"]["name"] == "get_weather"
    assert sent["temperature"] == 0.2


@pytest.mark.parametrize("status", [429, 500, 503])
def test_transient_errors_are_retried_with_backoff(llm_server: LlmServer, status: int) -> None:
    req, scenario = request(llm_server, [error(status), error(status), text("third time")])
    p, sleeps = port()
    assert p.complete(req).text == "third time"
    assert llm_server.count(scenario) == 3, "one layer of retries: the SDK's own are off"
    assert len(sleeps.delays) == 2


def test_a_429_with_retry_after_is_not_waited_for_here_it_says_when_to_ask_again(llm_server: LlmServer) -> None:
    req, scenario = request(llm_server, [error(429, headers={"retry-after": "7"}), text("ok")])
    p, sleeps = port()
    with pytest.raises(LlmFailure) as info:
        p.complete(req)
    assert (info.value.code, info.value.transient, info.value.retry_after) == ("rate_limited", True, 7.0)
    assert info.value.model == f"openai/{scenario}"
    assert sleeps.delays == [], "the thread is given back: the step goes back until then (runtime/admission.py)"
    assert llm_server.count(scenario) == 1


def test_a_429_without_retry_after_is_retried_here(llm_server: LlmServer) -> None:
    req, scenario = request(llm_server, [error(429), text("ok")])
    p, sleeps = port()
    assert p.complete(req).text == "ok"
    assert len(sleeps.delays) == 1 and llm_server.count(scenario) == 2


def test_the_retry_budget_ends_in_a_transient_failure(llm_server: LlmServer) -> None:
    req, scenario = request(llm_server, [error(500, "overloaded")])
    with pytest.raises(LlmFailure) as info:
        port(attempts=3)[0].complete(req)
    assert info.value.transient and info.value.code == "server_error"
    assert "after 3 attempts" in info.value.message
    assert llm_server.count(scenario) == 3


@pytest.mark.parametrize(
    ("status", "message", "code"),
    [
        (401, "invalid api key", "auth_error"),
        (400, "bad request body", "bad_request"),
        (400, "This model's maximum context length is 8192 tokens", "context_window_exceeded"),
        (404, "model not found", "model_not_found"),
    ],
)
def test_permanent_errors_fail_at_once_with_the_providers_message(
    llm_server: LlmServer, status: int, message: str, code: str
) -> None:
    req, scenario = request(llm_server, [error(status, message)])
    with pytest.raises(LlmFailure) as info:
        port()[0].complete(req)
    assert not info.value.transient
    assert info.value.code == code
    assert message.split()[0] in info.value.message
    assert llm_server.count(scenario) == 1


def test_a_fallback_model_answers_when_the_first_fails(llm_server: LlmServer) -> None:
    backup = llm_server.scenario([text("from the backup")])
    req, primary = request(
        llm_server, [error(503)], fallbackModels=[{"model": f"openai/{backup}", "apiBase": llm_server.url}]
    )
    turn = port(attempts=2)[0].complete(req)
    assert turn.text == "from the backup"
    assert llm_server.count(primary) == 2 and llm_server.count(backup) == 1


def test_every_model_failing_names_each(llm_server: LlmServer) -> None:
    backup = llm_server.scenario([error(401, "backup key refused")])
    req, _ = request(
        llm_server,
        [error(400, "primary says no")],
        fallbackModels=[{"model": f"openai/{backup}", "apiBase": llm_server.url}],
    )
    with pytest.raises(LlmFailure) as info:
        port()[0].complete(req)
    assert "primary says no" in info.value.message and "backup key refused" in info.value.message


def test_a_missing_api_key_variable_is_a_clear_permanent_failure(
    llm_server: LlmServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CELERY_AGENTS_TEST_KEY", raising=False)
    req, scenario = request(llm_server, [text("never")], apiKeyEnv="CELERY_AGENTS_TEST_KEY")
    with pytest.raises(LlmFailure) as info:
        port()[0].complete(req)
    assert info.value.code == "missing_api_key" and "CELERY_AGENTS_TEST_KEY" in info.value.message
    assert llm_server.count(scenario) == 0


def test_the_api_key_comes_from_the_named_variable(llm_server: LlmServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CELERY_AGENTS_TEST_KEY", "sk-test-123")
    req, scenario = request(llm_server, [text("ok")], apiKeyEnv="CELERY_AGENTS_TEST_KEY")
    port()[0].complete(req)
    assert llm_server.requests[scenario][-1]["_authorization"] == "Bearer sk-test-123"


def test_a_slow_model_times_out_as_a_transient_failure(llm_server: LlmServer) -> None:
    req, _ = request(llm_server, [Reply(content="late", delay=2.0)])
    p = LitellmPort(RetryPolicy(attempts=1, backoff=0.01, timeout=0.5), sleep=lambda s: None)
    with pytest.raises(LlmFailure) as info:
        p.complete(req)
    assert info.value.transient and info.value.code in ("timeout", "connection_error")


def test_classification_of_plain_exceptions() -> None:
    assert classify(TimeoutError("slow")).transient
    assert classify(ConnectionError("reset")).transient
    assert not classify(ValueError("weird")).transient


@pytest.mark.parametrize(("provider", "variable"), [("openai", "OPENAI_API_KEY"), ("anthropic", "ANTHROPIC_API_KEY")])
def test_a_workers_provider_key_never_goes_to_an_apibase_that_did_not_ask_for_it(
    llm_server: LlmServer, monkeypatch: pytest.MonkeyPatch, provider: str, variable: str
) -> None:
    secret = f"sk-worker-secret-{provider}"
    monkeypatch.setenv(variable, secret)
    scenario = llm_server.scenario([text("ok")])
    spec = parse_agent({"slug": "t", "model": f"{provider}/{scenario}", "apiBase": llm_server.url})
    req = LlmRequest(agent=spec, messages=[{"role": "user", "content": "hi"}], tools=[])
    with contextlib.suppress(LlmFailure):  # an Anthropic client cannot read the OpenAI-shaped answer
        port(attempts=1)[0].complete(req)
    sent = llm_server.requests[scenario]
    assert sent, "the request reached the endpoint"
    assert secret not in json.dumps(sent), "the worker's key went to an endpoint the agent file chose"


def test_a_fallback_models_apibase_gets_no_worker_key_either(
    llm_server: LlmServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-worker-secret-fallback")
    backup = llm_server.scenario([text("from the backup")])
    req, primary = request(
        llm_server, [error(401, "no")], fallbackModels=[{"model": f"openai/{backup}", "apiBase": llm_server.url}]
    )
    port()[0].complete(req)
    for scenario in (primary, backup):
        assert "sk-worker-secret" not in json.dumps(llm_server.requests[scenario])


@pytest.mark.parametrize("field", ["api_key", "api_base", "base_url"])
def test_model_params_cannot_carry_an_endpoint_or_a_key(field: str) -> None:
    from celery_agents.errors import InvalidAgentFile

    with pytest.raises(InvalidAgentFile) as info:
        parse_agent({"slug": "t", "model": "openai/x", "modelParams": {field: "http://elsewhere"}}, "a.json")
    assert "modelParams" in info.value.message and field in info.value.message


@pytest.mark.parametrize("where", ["agent", "fallback"])
@pytest.mark.parametrize("name", ["AGENTS_REDIS_URL", "agents_spec_key"])
def test_api_key_env_cannot_name_a_worker_setting(where: str, name: str) -> None:
    from celery_agents.errors import InvalidAgentFile

    data: dict[str, Any] = {"slug": "t", "model": "openai/x", "apiBase": "http://127.0.0.1:9/v1"}
    if where == "agent":
        data["apiKeyEnv"] = name
    else:
        data["fallbackModels"] = [{"model": "openai/y", "apiBase": "http://127.0.0.1:9/v1", "apiKeyEnv": name}]
    with pytest.raises(InvalidAgentFile) as info:
        parse_agent(data, "a.json")
    assert "apiKeyEnv" in info.value.message and name in info.value.message


def test_an_mcp_servers_headers_cannot_carry_a_worker_setting() -> None:
    from pydantic import ValidationError

    from celery_agents.model.mcp import McpServer

    with pytest.raises(ValidationError) as info:
        McpServer.model_validate(
            {"name": "s", "url": "http://127.0.0.1:9/mcp", "headersEnv": {"Authorization": "AGENTS_REDIS_URL"}}
        )
    assert "AGENTS_REDIS_URL" in str(info.value)
