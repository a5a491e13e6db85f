"""Tracked tool calls: one per call the model asked for, with the policy applied and its state."""

from __future__ import annotations

import hashlib
import json
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from celery_agents.model.agent import DispositionTag


class CallState(StrEnum):
    READY = "ready"
    RUNNING = "running"
    DEFERRED = "deferred"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def final(self) -> bool:
        return self in _FINAL


_FINAL = {CallState.COMPLETED, CallState.FAILED, CallState.CANCELLED, CallState.EXPIRED}
FINAL_STATES = frozenset(s.value for s in _FINAL)
#: what running a call can end in (`scheduler.ports.CallOutcome.state`): the values of
#: `CallState.COMPLETED` and `CallState.FAILED`
OutcomeState = Literal["completed", "failed"]


class TrackedCall(BaseModel):
    """A call of the newest LLM turn: where it runs, how far it got, its result once final.

    `batch` is the index of its `LlmTurn` in the transcript and `position` its place in the
    model's call order; together with the session they make the call's idempotency key.
    """

    model_config = ConfigDict(extra="ignore", defer_build=True)  # built on first use (see agent._Spec)

    call_id: str
    tool: str
    arguments: Any = None
    raw_arguments: str = "{}"
    batch: int
    position: int
    disposition: DispositionTag
    reason: str | None = None
    state: CallState = CallState.READY
    result: Any = None
    error: str | None = None
    token: str | None = None
    attempts: int = 0
    created_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    expires_at: float | None = None
    duration_ms: float | None = None
    exit_status: int | None = None
    completed_by: str | None = None
    #: W3C trace context of the step that deferred the call (tracing on): its completion, days
    #: later, joins the session's trace
    traceparent: str | None = None
    meta: dict[str, Any] = Field(default_factory=dict)

    @property
    def field(self) -> str:
        """The call's key in the session's call ledger."""
        return call_field(self.batch, self.position)

    def idempotency_key(self, session_id: str) -> str:
        return f"{session_id}:{self.batch}:{self.call_id}"

    def digest(self) -> str:
        """A digest of the tool name and arguments the call's token is bound to."""
        body = json.dumps([self.tool, self.raw_arguments], separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()[:32]


def call_field(batch: int, position: int) -> str:
    return f"{batch}:{position}"
