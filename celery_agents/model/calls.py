"""Tracked tool calls: one per call the model asked for, with the policy applied and its state."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationError,
    model_serializer,
    model_validator,
)

from celery_agents.model.agent import DispositionTag
from celery_agents.model.turns import Media


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
#: what running a call can end in (`CallOutcome.state`): the values of `CallState.COMPLETED` and
#: `CallState.FAILED`
OutcomeState = Literal["completed", "failed"]


class CallMeta(BaseModel):
    """What a call's run and its links left beside its result, as typed fields. Stored as the
    call's `meta` object exactly as it was given: the keys that were set, in their order, `null`s
    and keys of no field kept. A stored value of the wrong type reads as unset (and is kept).
    Frozen: `|` and `without` make another."""

    model_config = ConfigDict(extra="allow", frozen=True, defer_build=True)

    #: a sub-agent call: its child session (`child_session_id` of the call)
    child: str | None = None
    #: a rerun's call: the origin's call whose outcome it reused (`<session id>:<field>`)
    reused_from: str | None = None
    #: an approved gate: the decision (approved, edited) and who took it
    decision: str | None = None
    decided_by: str | None = None
    #: media the tool returned (`Media` as JSON), given to the model with the result
    media: list[dict[str, Any]] | None = None
    #: the arguments did not fit the tool's schema or signature: the tool did not run
    invalid_arguments: bool | None = None
    #: the tool marked the failure worth another attempt (exit status 75, `retryable = True`)
    retryable: bool | None = None
    timed_out: bool | None = None
    #: the signal that killed the tool's process
    signal: int | None = None
    #: the errors of the failed attempts before the last (`retries`)
    earlier_attempts: list[str] | None = None
    #: `truncate` cut the result: `{"bytes", "limit"}`
    truncated: dict[str, int] | None = None
    #: the output was cut at the output cap: `{"written", "cap"}`
    output_capped: dict[str, int] | None = None
    #: the result was larger than AGENTS_MAX_RESULT_BYTES: `{"size", "cap"}`
    result_capped: dict[str, int] | None = None
    #: a runIsolated run: how it was contained (`bwrap`, `namespaces`, `none`), the uid it ran as
    #: (why not, in `uid_note`), its limits, what memoryMb bounded (`run`, `process`) and how many
    #: of its processes the kernel killed for memory
    isolation: str | None = None
    uid: int | None = None
    uid_note: str | None = None
    limits: dict[str, Any] | None = None
    memory_scope: str | None = None
    oom_kills: int | None = None

    _stored: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _as_given(cls, value: Any, handler: ModelWrapValidatorHandler[CallMeta]) -> CallMeta:
        if isinstance(value, CallMeta):
            return value
        try:
            meta = handler(value)
        except ValidationError as exc:
            if not isinstance(value, dict):
                raise
            wrong = {e["loc"][0] for e in exc.errors() if e["loc"]}
            meta = handler({k: v for k, v in value.items() if k not in wrong})
        meta._stored = dict(value)
        return meta

    @model_serializer(mode="plain")
    def _dumped(self) -> dict[str, Any]:
        return dict(self._stored)

    def stored(self) -> dict[str, Any]:
        """The JSON object the call stores."""
        return dict(self._stored)

    def without(self, *keys: str) -> CallMeta:
        return CallMeta.model_validate({k: v for k, v in self._stored.items() if k not in keys})

    def __or__(self, more: CallMeta) -> CallMeta:
        """These fields with those set in `more` over them."""
        return CallMeta.model_validate({**self._stored, **more._stored})

    def __bool__(self) -> bool:
        """Whether any key is set."""
        return bool(self._stored)


@dataclass
class CallOutcome:
    """What executing one tool call produced; `meta` is what the run left beside its result (a
    tool source sets its fields: `CallMeta(timed_out=True)`; a wrapper adds some: `meta |
    CallMeta(...)`)."""

    state: OutcomeState
    result: Any = None
    error: str | None = None
    duration_ms: float | None = None
    exit_status: int | None = None
    attempts: int = 1
    media: list[Media] = field(default_factory=list)
    meta: CallMeta = field(default_factory=CallMeta)

    @property
    def call_state(self) -> CallState:
        return CallState(self.state)

    def stored_meta(self) -> CallMeta:
        """`meta` as a call stores it: with the media the tool returned under `media`."""
        if not self.media:
            return self.meta
        return self.meta | CallMeta(media=[m.model_dump() for m in self.media])


class TrackedCall(BaseModel):
    """A call of the newest LLM turn: where it runs, how far it got, its result once final.

    `batch` is the index of its `LlmTurn` in the transcript and `position` its place in the
    model's call order; together with the session they make the call's idempotency key.
    """

    model_config = ConfigDict(extra="ignore", defer_build=True)  # built on first use (see agent._Spec)

    call_id: str
    tool: str
    arguments: Any = None
    #: the model's text of the arguments (what it asked, whatever an approval made of `arguments`);
    #: stored only when it does not parse to `arguments` (`stored_json`), else read back as their
    #: JSON (`with_raw_arguments`): the model's exact text is in its turn
    raw_arguments: str = "{}"
    batch: int
    position: int
    disposition: DispositionTag
    #: an approval gate's disposition once approved (`defer` with `then`)
    then: DispositionTag | None = None
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
    meta: CallMeta = Field(default_factory=CallMeta)

    @model_validator(mode="before")
    @classmethod
    def _raw_arguments_read_back(cls, data: Any) -> Any:
        return with_raw_arguments(data) if isinstance(data, dict) else data

    def stored_json(self) -> str:
        """The call as its session stores it: its fields but their defaults, and its arguments'
        text only when it says more than the arguments (they did not parse)."""
        stored = self.model_dump(mode="json", exclude_defaults=True)
        if self.arguments is not None and "raw_arguments" in stored and _parses_to(self.raw_arguments, self.arguments):
            del stored["raw_arguments"]
        return json.dumps(stored, ensure_ascii=False, separators=(",", ":"))

    @property
    def runs_as(self) -> DispositionTag:
        """The disposition the call runs under: an approval gate's `then`, else its own."""
        return self.then if self.disposition == "defer" and self.then is not None else self.disposition

    @property
    def field(self) -> str:
        """The call's key in the session's call ledger."""
        return call_field(self.batch, self.position)

    def idempotency_key(self, session_id: str) -> str:
        return f"{session_id}:{self.batch}:{self.call_id}"

    def digest(self) -> str:
        """What a decision on the call is bound to: lowercase hex SHA-256 of the canonical JSON
        `{"arguments": ..., "tool": ...}` (keys sorted, no spaces)."""
        return call_digest(self.tool, self.arguments)


def with_raw_arguments(data: dict[str, Any]) -> dict[str, Any]:
    """A stored call's JSON object with `raw_arguments` read back where it was left out (its
    arguments parsed: their JSON). Apply it before laying an outcome over the call, whose
    `arguments` may be an approval's edit."""
    if "raw_arguments" in data or data.get("arguments") is None:
        return data
    return {**data, "raw_arguments": json.dumps(data["arguments"], ensure_ascii=False)}


def _parses_to(text: str, arguments: Any) -> bool:
    try:
        return bool(json.loads(text) == arguments)
    except ValueError:
        return False


def call_digest(tool: str, arguments: Any) -> str:
    body = json.dumps({"tool": tool, "arguments": arguments}, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(body.encode()).hexdigest()


def call_field(batch: int, position: int) -> str:
    return f"{batch}:{position}"
