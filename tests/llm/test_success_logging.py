"""litellm's success logging: skipped when no callback listens (it costs a third of a demo model
call's CPU and a thread that takes the GIL as the step commits), kept for an operator's callbacks."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from celery_agents.llm import LitellmPort, RetryPolicy, ensure_litellm
from celery_agents.scheduler import LlmRequest
from celery_agents.tools.resolve import parse_agent
from tests.support.llm_server import LlmServer, text

LISTS = ("callbacks", "success_callback", "_async_success_callback", "input_callback", "failure_callback")


def requests(llm_server: LlmServer) -> list[LlmRequest]:
    """One call answered in this process (the demo model), one over the network."""
    scenario = llm_server.scenario([text("ok")])
    agents = [
        parse_agent({"slug": "t", "model": "demo/t"}),
        parse_agent({"slug": "t", "model": f"openai/{scenario}", "apiBase": llm_server.url}),
    ]
    return [LlmRequest(agent=a, messages=[{"role": "user", "content": "hi"}], tools=[]) for a in agents]


def scenario_of(request: LlmRequest) -> str:
    return request.agent.model.split("/", 1)[1]


@pytest.fixture
def litellm(monkeypatch: pytest.MonkeyPatch) -> Any:
    """litellm with its callback lists emptied for the test (and put back after it)."""
    lib = ensure_litellm()
    for name in LISTS:
        monkeypatch.setattr(lib, name, [])
    return lib


class Recorder:
    """Stands in for litellm's logging executor: records what is submitted, runs it as before."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.submitted = inner, 0

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        self.submitted += 1
        return self.inner.submit(*args, **kwargs)


def test_with_no_callback_configured_no_success_log_is_built(
    litellm: Any, llm_server: LlmServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import litellm.utils as lu

    executor = Recorder(lu.executor)
    scheduled: list[Any] = []
    monkeypatch.setattr(lu, "executor", executor)
    monkeypatch.setattr(lu, "_schedule_async_success_logging", lambda **kw: scheduled.append(kw))
    port = LitellmPort(RetryPolicy(attempts=1))
    turns = [port.complete(r) for r in requests(llm_server)]
    assert all(t.usage.total_tokens > 0 for t in turns)  # usage still mapped from the response
    assert executor.submitted == 0, "a sync call handed litellm's logging thread a success log"
    assert scheduled == [], "an async call scheduled litellm's success logging"


def test_an_operators_callback_still_hears_every_call(litellm: Any, llm_server: LlmServer) -> None:
    from litellm.integrations.custom_logger import CustomLogger

    class Heard(CustomLogger):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.models: list[str] = []
            self.both = threading.Event()

        def _heard(self, kwargs: dict[str, Any]) -> None:
            self.models.append(str(kwargs.get("model")))
            if len(self.models) >= 2:
                self.both.set()

        def log_success_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
            self._heard(kwargs)

        async def async_log_success_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
            self._heard(kwargs)

    heard = Heard()
    litellm.callbacks = [heard]
    port = LitellmPort(RetryPolicy(attempts=1))
    reqs = requests(llm_server)
    for r in reqs:
        port.complete(r)
    assert heard.both.wait(10), f"the callback heard {heard.models}"
    # litellm names a call by the model without its provider: the demo's `t`, the server's scenario
    assert sorted(heard.models) == sorted(["t", scenario_of(reqs[1])])
