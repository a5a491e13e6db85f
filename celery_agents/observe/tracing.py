"""OpenTelemetry traces (extra `otel`): one trace per session, across workers and completions.

Imported only when tracing is on. The trace context travels in the Celery message headers (W3C
`traceparent`, injected at publish by a `before_task_publish` handler, read back from the task's
request) and is stored with each deferred call, so the completion that ends a wait days later,
and the step it wakes, join the trace of the step that deferred it. Model-call spans follow the
GenAI semantic conventions (`gen_ai.*`). Spans go to the OTLP/HTTP exporter, which reads the
`OTEL_EXPORTER_OTLP_*` variables itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
KINDS = {"internal": SpanKind.INTERNAL, "client": SpanKind.CLIENT, "consumer": SpanKind.CONSUMER}


class _RequestGetter(Getter[Any]):
    """Reads `traceparent` from a Celery task request (custom headers become its attributes) or a dict."""

    def get(self, carrier: Any, key: str) -> list[str] | None:
        value = carrier.get(key) if isinstance(carrier, Mapping) else getattr(carrier, key, None)
        return [value] if isinstance(value, str) else None

    def keys(self, carrier: Any) -> list[str]:
        return list(carrier) if isinstance(carrier, Mapping) else []


_getter = _RequestGetter()


class Tracing:
    """The process's tracer provider, and the publish hook that carries the context."""

    def __init__(self, exporter: SpanExporter | None = None, *, batch: bool = True) -> None:
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        self.provider = TracerProvider(resource=Resource.create({"service.name": "celery-agents"}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("celery_agents")
        from celery.signals import before_task_publish

        before_task_publish.connect(_inject_into_headers, weak=False)

    @contextlib.contextmanager
    def span(
        self,
        name: str,
        attributes: Mapping[str, Any],
        *,
        parent: Any = None,
        kind: str = "internal",
        start_s: float | None = None,
    ) -> Iterator[trace.Span]:
        """A span, current inside; `parent` a task request, a dict or a `traceparent` string whose
        context it continues (else the current span's, or a new trace)."""
        ctx = None
        if isinstance(parent, str):
            parent = {"traceparent": parent}
        if parent is not None:
            ctx = _propagator.extract(parent, getter=_getter)
        start = int(start_s * 1e9) if start_s else None
        with self.tracer.start_as_current_span(
            name,
            context=ctx,
            kind=KINDS[kind],
            attributes={k: v for k, v in attributes.items() if v is not None},
            start_time=start,
            record_exception=True,
            set_status_on_exception=True,
        ) as span:
            yield span

    def shutdown(self) -> None:
        self.provider.shutdown()


def current_traceparent() -> str | None:
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get("traceparent")


def set_attributes(span: trace.Span, attributes: Mapping[str, Any]) -> None:
    span.set_attributes({k: v for k, v in attributes.items() if v is not None})


def mark_error(span: trace.Span, description: str) -> None:
    span.set_status(Status(StatusCode.ERROR, description))


def _inject_into_headers(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Celery's publish signal: the current span's context rides in the message's headers."""
    if headers is not None and trace.get_current_span().get_span_context().is_valid:
        _propagator.inject(headers)
