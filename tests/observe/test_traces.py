"""Spans into an in-memory exporter: the context a publish carries, the step that continues it,
GenAI attributes of a model call, and a deferred call's wait joining the deferring step's trace."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from celery_agents import observe
from celery_agents.model import CallState, LlmTurn, TrackedCall, Usage
from celery_agents.observe.tracing import Tracing, _inject_into_headers


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    tracing = Tracing(memory, batch=False)
    observe.use_tracing(tracing)
    yield memory
    observe.use_tracing(None)
    tracing.shutdown()


def published_headers() -> dict[str, Any]:
    """What Celery's publish signal leaves in a message's headers, here and now."""
    headers: dict[str, Any] = {}
    _inject_into_headers(headers=headers)
    return headers


def test_a_step_continues_the_trace_of_the_step_that_published_it(exporter: InMemorySpanExporter) -> None:
    with observe.step(SimpleNamespace(hostname="a@h"), "s1", 1):
        headers = published_headers()
    assert headers["traceparent"]
    # Celery hands custom headers to the task as attributes of its request.
    with observe.step(SimpleNamespace(hostname="b@h", **headers), "s1", 2) as watch:
        watch.outcome = "committed"
    first, second = exporter.get_finished_spans()
    assert second.parent is not None and second.parent.span_id == first.context.span_id
    assert second.context.trace_id == first.context.trace_id
    assert dict(second.attributes or {})["agents.outcome"] == "committed"


def test_a_message_published_outside_any_span_carries_no_context(exporter: InMemorySpanExporter) -> None:
    assert "traceparent" not in published_headers()


def test_a_model_call_span_has_the_genai_attributes(exporter: InMemorySpanExporter) -> None:
    turn = LlmTurn(text="hi", usage=Usage(prompt_tokens=12, completion_tokens=3), model="gpt-x", finish_reason="stop")
    with observe.model_call("openai/gpt-x") as watch:
        observe.model_answered(watch, "openai/gpt-x", turn)
    (span,) = exporter.get_finished_spans()
    attrs = dict(span.attributes or {})
    assert span.name == "chat openai/gpt-x"
    assert attrs["gen_ai.request.model"] == "openai/gpt-x" and attrs["gen_ai.provider.name"] == "openai"
    assert attrs["gen_ai.usage.input_tokens"] == 12 and attrs["gen_ai.usage.output_tokens"] == 3
    assert attrs["gen_ai.response.finish_reasons"] == ("stop",)


def test_a_failed_model_call_marks_its_span_with_the_error_code(exporter: InMemorySpanExporter) -> None:
    class RateLimited(Exception):
        code = "rate_limited"

    with pytest.raises(RateLimited), observe.model_call("openai/gpt-x"):
        raise RateLimited()
    (span,) = exporter.get_finished_spans()
    assert dict(span.attributes or {})["agents.outcome"] == "rate_limited"
    assert not span.status.is_ok


def test_a_completion_days_later_joins_the_trace_of_the_step_that_deferred_the_call(
    exporter: InMemorySpanExporter,
) -> None:
    call = TrackedCall(call_id="c1", tool="approve", batch=1, position=0, disposition="defer",
                       state=CallState.DEFERRED, created_at=1_000_000.0)  # fmt: skip
    with observe.step(SimpleNamespace(hostname="a@h"), "s1", 1):
        (stamped,) = observe.stamp_deferred([call])
    assert stamped.traceparent

    class Store:
        def call_of_token(self, token: str) -> tuple[TrackedCall, str]:
            return stamped, "hash"

        def agent(self, agent_hash: str, session_id: str | None = None) -> Any:
            return SimpleNamespace(tool=lambda name: object())

    with observe.token_wait(Store(), "s1.secret", "alice"):  # type: ignore[arg-type]
        woken = published_headers()
    step, wait = exporter.get_finished_spans()
    assert wait.parent is not None and wait.parent.span_id == step.context.span_id
    assert wait.start_time == 1_000_000 * 10**9  # from the deferral
    attrs = dict(wait.attributes or {})
    assert attrs["agents.completed_by"] == "alice" and attrs["gen_ai.tool.name"] == "approve"
    assert woken["traceparent"].split("-")[2] == format(wait.context.span_id, "016x")
