"""Observing the work: Prometheus metrics, OpenTelemetry traces and log context, in one place.

The step, tool-call, model-call and completion code paths call the few context managers and
functions here; they count, open spans (when tracing is on) and name the session, step version and
call of every log line. Counts go to the `Tally` of the work in hand (a step, a dispatched call),
which the script recording that work adds to the fleet's counters in Redis (store/counters.py);
the step latency histogram is this process's own (when the worker serves `--metrics-port`). With
neither metrics nor tracing enabled, nothing here imports prometheus-client or OpenTelemetry.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from celery_agents.observe.logs import add_context, log_context

if TYPE_CHECKING:
    from celery_agents.config import Settings
    from celery_agents.model import AgentSpec, CallOutcome, LlmTurn, TrackedCall
    from celery_agents.observe.tracing import Tracing
    from celery_agents.store import Store
    from celery_agents.store.counters import Counts

__all__ = ["add_context", "log_context"]

#: the series module (observe.series) once this process serves its histogram; None: no metrics
_series: ModuleType | None = None
_tracing: Tracing | None = None


class Tally:
    """What one piece of work counted (a step; a runAsync/runIsolated call): counter key (series,
    label values) -> amount, for the script that records the work to add to the fleet's counters."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, ...], int] = {}

    def add(self, *key: str, n: int = 1) -> None:
        if n:
            self.counts[key] = self.counts.get(key, 0) + n


#: the tally of the work this thread is doing, if any: the hooks below count into it
_tally: contextvars.ContextVar[Tally | None] = contextvars.ContextVar("celery_agents_tally", default=None)


@contextlib.contextmanager
def tallying(tally: Tally | None = None) -> Iterator[Tally]:
    """Count what the hooks see inside into `tally` (a new one if not given)."""
    tally = tally or Tally()
    token = _tally.set(tally)
    try:
        yield tally
    finally:
        _tally.reset(token)


def _count(*key: str, n: int = 1) -> None:
    tally = _tally.get()
    if tally is not None:
        tally.add(*key, n=n)


def setup(settings: Settings) -> None:
    """Turn on what the settings ask for, once per process."""
    global _series, _tracing
    if settings.metrics_dir is not None and _series is None:
        from celery_agents.observe.metrics import open_series

        _series = open_series(settings.metrics_dir)
    if settings.tracing_on and _tracing is None:
        from celery_agents.observe.tracing import Tracing

        _tracing = Tracing()


def use_tracing(tracing: Tracing | None) -> None:
    """Trace into this one (tests: an in-memory exporter), or stop tracing (None)."""
    global _tracing
    _tracing = tracing


def flush() -> None:
    """Send the spans still buffered (a pool process about to exit)."""
    if _tracing is not None:
        _tracing.provider.force_flush(5000)


@dataclass
class Watch:
    """What an observed piece of work reports back: how it ended, and attributes for its span."""

    outcome: str = "ok"
    attributes: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def set(self, **attributes: Any) -> None:
        self.attributes.update(attributes)


@contextlib.contextmanager
def _span(name: str, attributes: dict[str, Any], watch: Watch, **kw: Any) -> Iterator[None]:
    if _tracing is None:
        yield
        return
    from celery_agents.observe.tracing import mark_error, set_attributes

    with _tracing.span(name, attributes, **kw) as span:
        try:
            yield
        finally:
            set_attributes(span, {**watch.attributes, "agents.outcome": watch.outcome})
            if watch.error:
                mark_error(span, watch.error)


def _worker(request: Any) -> str | None:
    """The Celery worker (hostname) running a task."""
    name = getattr(request, "hostname", None)
    return name if isinstance(name, str) else None


@contextlib.contextmanager
def step(request: Any, session_id: str, version: int) -> Iterator[Watch]:
    """One step task; `request` (the Celery task request) carries the publisher's trace context."""
    watch, started = Watch(), time.perf_counter()
    attributes = {"agents.session_id": session_id, "agents.version": version, "agents.worker": _worker(request)}
    with (
        log_context(session_id=session_id, version=version),
        _span("agents.step", attributes, watch, parent=request, kind="consumer"),
    ):
        try:
            yield watch
        except BaseException as exc:
            watch.outcome, watch.error = "error", type(exc).__name__
            raise
        finally:
            if _series is not None:  # its outcome is counted by the script that ends it
                _series.step_seconds.observe(time.perf_counter() - started)


@contextlib.contextmanager
def call_task(request: Any, session_id: str, field: str) -> Iterator[None]:
    """One runAsync/runIsolated task: its log lines and its spans continue the dispatching step's trace."""
    attributes = {"agents.session_id": session_id, "agents.call_field": field, "agents.worker": _worker(request)}
    with (
        log_context(session_id=session_id, call=field),
        _span("agents.call_task", attributes, Watch(), parent=request, kind="consumer"),
    ):
        yield


@contextlib.contextmanager
def model_call(model: str) -> Iterator[Watch]:
    """One call of the agent file's `model` (its retries included); report the answer with
    `model_answered`."""
    watch = Watch()
    provider = model.split("/", 1)[0] if "/" in model else "openai"
    attributes = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": provider, "gen_ai.request.model": model}
    with _span(f"chat {model}", attributes, watch, kind="client"):
        try:
            yield watch
        except Exception as exc:
            watch.outcome = str(getattr(exc, "code", "") or "error")[:40]
            watch.error = watch.outcome
            raise
        finally:
            _count("model_calls", model_label(model), watch.outcome)


def model_answered(watch: Watch, model: str, turn: LlmTurn) -> None:
    """Tokens and finish reason of a model's answer (GenAI attributes on the span)."""
    u = turn.usage
    watch.set(
        **{
            "gen_ai.response.model": turn.model or None,
            "gen_ai.usage.input_tokens": u.prompt_tokens,
            "gen_ai.usage.output_tokens": u.completion_tokens,
            "gen_ai.response.finish_reasons": [turn.finish_reason] if turn.finish_reason else None,
            "gen_ai.usage.reasoning_tokens": u.reasoning_tokens or None,
        }
    )
    for kind, count in (
        ("input", u.prompt_tokens),
        ("output", u.completion_tokens),
        ("reasoning", u.reasoning_tokens),
        ("cached", u.cached_tokens),
    ):
        _count("model_tokens", model_label(model), kind, n=count or 0)


def model_label(model: str) -> str:
    """A model as a label: the agent file's name for it (a bounded set), cut to 200 characters."""
    return model[:200]


def tool_label(agent: AgentSpec | None, name: str) -> str:
    """A tool name as a label: one the agent file names, else `_other` (the model's text is unbounded)."""
    return name[:64] if agent is not None and agent.tool(name) is not None else "_other"


@contextlib.contextmanager
def tool_call(agent: AgentSpec | None, call: TrackedCall) -> Iterator[Watch]:
    """One run of a tool (inline or in a tool task); report its `CallOutcome` with `tool_ran`."""
    watch = Watch(outcome="failed")
    tool = tool_label(agent, call.tool)
    attributes = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": tool,
        "gen_ai.tool.call.id": call.call_id,
        "agents.disposition": call.disposition,
    }
    with log_context(call_id=call.call_id), _span(f"execute_tool {tool}", attributes, watch):
        try:
            yield watch
        finally:
            _count("tool_calls", tool, call.disposition, watch.outcome)


def call_refused(lane: str) -> Counts:
    """A dispatched call whose stored record the signed spec does not allow in `lane` ran nothing:
    what recording its refusal counts."""
    return {("calls_refused", lane): 1}


def tool_ran(watch: Watch, outcome: CallOutcome) -> None:
    watch.outcome = "completed" if outcome.state == "completed" else "failed"
    if watch.outcome == "failed":
        watch.error = (outcome.error or "failed")[:200]
    sandbox, kills = outcome.meta.isolation, outcome.meta.oom_kills
    watch.set(**{"agents.sandbox": sandbox, "agents.oom_kills": kills, "agents.exit_status": outcome.exit_status})
    if isinstance(kills, int) and kills > 0:
        _count("sandbox_oom_kills", n=kills)


@contextlib.contextmanager
def token_wait(store: Store, token: str, by: str | None) -> Iterator[Watch]:
    """A deferred call's wait, from its deferral to this completion, in the trace of the step that
    deferred it; the step its completion wakes is published inside, so it joins that trace too.
    (complete_token.lua counts the completion and the call.)"""
    watch = Watch(outcome="completed")
    if _tracing is None:
        yield watch
        return
    found = store.call_of_token(token)
    call = found[0] if found is not None else None
    agent = _agent_of(store, found[1], token.partition(".")[0]) if found is not None else None
    tool = tool_label(agent, call.tool) if call is not None else "_other"
    attributes = {
        "agents.session_id": token.partition(".")[0],
        "agents.completed_by": by or "",
        "gen_ai.tool.name": tool,
        "gen_ai.tool.call.id": call.call_id if call else "",
    }
    parent = call.traceparent if call is not None else None
    start = call.created_at if call is not None and call.created_at else None
    with _span("agents.token_wait", attributes, watch, parent=parent or {}, start_s=start):
        try:
            yield watch
        except Exception as exc:
            watch.outcome = str(getattr(exc, "code", "") or "error")
            raise


def _agent_of(store: Store, agent_hash: str, session_id: str) -> AgentSpec | None:
    with contextlib.suppress(Exception):  # a missing or unsigned spec: the tool is `_other`
        return store.agent(agent_hash, session_id)
    return None


def stamp_deferred(calls: list[TrackedCall]) -> list[TrackedCall]:
    """Deferred calls carry the current trace context, so that their completion joins the trace."""
    if _tracing is None:
        return calls
    from celery_agents.model import CallState
    from celery_agents.observe.tracing import current_traceparent

    parent = current_traceparent()
    if parent is None:
        return calls
    return [
        c.model_copy(update={"traceparent": parent}) if c.state == CallState.DEFERRED and c.traceparent is None else c
        for c in calls
    ]
