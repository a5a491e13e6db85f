"""A model litellm has no price for (a self-hosted server behind `apiBase`, mostly) is looked up in
its price map once per process, not after every call: litellm's search for a price it does not have
was a tenth of a steps process's CPU with 1,000 sessions in flight. Costs that exist are still
reported on every call, and a price registered later is used from then on."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from celery_agents.llm import LitellmPort, RetryPolicy, ensure_litellm
from celery_agents.scheduler import LlmRequest
from celery_agents.tools.resolve import parse_agent
from tests.support.llm_server import LlmServer, text


def ask(port: LitellmPort, llm_server: LlmServer, model: str) -> float | None:
    llm_server.script(model, [text("ok")])
    agent = parse_agent({"slug": "t", "model": f"openai/{model}", "apiBase": llm_server.url})
    turn = port.complete(LlmRequest(agent=agent, messages=[{"role": "user", "content": "hi"}], tools=[]))
    assert turn.usage.total_tokens > 0
    return turn.usage.cost


@pytest.fixture
def searches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The models litellm searched its price map for, call by call."""
    ensure_litellm()
    import litellm.cost_calculator as cc

    seen: list[str] = []
    inner = cc.completion_cost

    def completion_cost(*args: Any, **kwargs: Any) -> Any:
        seen.append(str(kwargs.get("model")))
        return inner(*args, **kwargs)

    monkeypatch.setattr(cc, "completion_cost", completion_cost)
    return seen


def test_a_model_without_a_price_is_searched_for_once(llm_server: LlmServer, searches: list[str]) -> None:
    port = LitellmPort(RetryPolicy(attempts=1))
    model = f"selfhosted-{uuid.uuid4().hex[:8]}"
    costs = [ask(port, llm_server, model) for _ in range(4)]
    assert costs == [None] * 4, "a model with no price has no cost"
    assert searches.count(f"openai/{model}") == 1, f"litellm searched its price map on every call: {searches}"


def test_a_model_without_a_price_is_not_diagnosed_again_while_no_callback_listens(
    llm_server: LlmServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """litellm diagnoses a zero cost for its callbacks by searching its price map once more; with
    none configured nobody reads the diagnosis, so a model known to have no price skips it."""
    ensure_litellm()
    import litellm.litellm_core_utils.litellm_logging as logging_module

    diagnosed: list[str] = []
    inner = logging_module.pricing_entry_for_cost_calc

    def pricing_entry_for_cost_calc(*args: Any, **kwargs: Any) -> Any:
        diagnosed.append(str(kwargs.get("model")))
        return inner(*args, **kwargs)

    monkeypatch.setattr(logging_module, "pricing_entry_for_cost_calc", pricing_entry_for_cost_calc)
    port = LitellmPort(RetryPolicy(attempts=1))
    model = f"selfhosted-{uuid.uuid4().hex[:8]}"
    assert [ask(port, llm_server, model) for _ in range(4)] == [None] * 4
    assert len(diagnosed) == 1, diagnosed


def test_a_priced_model_reports_its_cost_on_every_call(llm_server: LlmServer) -> None:
    port = LitellmPort(RetryPolicy(attempts=1))
    costs = [ask(port, llm_server, "gpt-4o-mini") for _ in range(3)]
    assert all(c is not None and c > 0 for c in costs), costs


def test_a_price_registered_later_is_used_from_then_on(llm_server: LlmServer) -> None:
    litellm = ensure_litellm()
    port = LitellmPort(RetryPolicy(attempts=1))
    model = f"selfhosted-{uuid.uuid4().hex[:8]}"
    assert [ask(port, llm_server, model) for _ in range(2)] == [None, None]
    key = f"openai/{model}"
    price = {"input_cost_per_token": 1e-6, "output_cost_per_token": 2e-6, "litellm_provider": "openai", "mode": "chat"}
    litellm.register_model({key: price})
    try:
        cost = ask(port, llm_server, model)
    finally:
        litellm.model_cost.pop(key, None)
    assert cost is not None and cost > 0


def test_what_a_model_server_names_itself_is_remembered_only_within_a_bound() -> None:
    """The answer's `model` comes from the server, which is untrusted: a server naming itself anew
    with a long name on every answer must not make the process keep a thousand long names."""
    from celery_agents.llm.adapter import UnpricedModels

    litellm = ensure_litellm()

    class Answer:
        def __init__(self, model: str) -> None:
            self.model, self._hidden_params = model, {}

    def original(**kwargs: Any) -> Any:
        raise litellm.exceptions.ModelNotMappedError("This model isn't mapped yet.")

    memo = UnpricedModels(litellm, original)
    for i in range(50):
        with pytest.raises(litellm.exceptions.ModelNotMappedError):
            memo(model="openai/x", custom_llm_provider="openai", response_object=Answer(f"{i}" + "m" * 100_000))
    assert sum(len(str(k)) for k in memo.known) < 10_000, "long server-given names were kept"
    with pytest.raises(litellm.exceptions.ModelNotMappedError):
        memo(model="openai/x", custom_llm_provider="openai", response_object=Answer("short"))
    assert len(memo.known) == 1
