"""The session header and the user-facing views of a session and its pending calls."""

from __future__ import annotations

import hashlib
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from celery_agents.model.admission import DEFAULT_PRIORITY
from celery_agents.model.budget import BUDGET_KINDS, Budget, BudgetKind, Spend
from celery_agents.model.slots import SUFFIX, id_in_slot, tag_slot
from celery_agents.model.turns import Usage


class Status(StrEnum):
    """Whether a session can still advance."""

    ACTIVE = "active"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class State(StrEnum):
    """What the next step would do (the contract's `state`)."""

    READY = "ready"
    TOOLS = "tools"
    RUNNING = "running"
    WAITING = "waiting"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def owes_step(self) -> bool:
        """An active session in this state is owed a step (the model to call, or tools to run)."""
        return self in STEP_OWING_STATES


#: the states in which an active session is owed a step (`_lib.lua` `OWES_STEP` mirrors them)
STEP_OWING_STATES = frozenset({State.READY, State.TOOLS})

Drive = Literal["manual", "auto"]


def child_session_id(parent_id: str, call_field: str) -> str:
    """The id of the child session a sub-agent call starts: derived from the call, so that every
    attempt to start it (a redelivered message, a worker after a crash) names the same session. It
    lands in its parent's Redis Cluster slot (model/slots.py), so that a session tree shares one."""
    base = hashlib.sha256(f"child:{parent_id}:{call_field}".encode()).hexdigest()[: 32 - SUFFIX]
    return id_in_slot(base, tag_slot(parent_id))


class _Model(BaseModel):
    # built on first use (see agent._Spec): `pending` builds PendingCall only, not every view
    model_config = ConfigDict(defer_build=True)


class ErrorInfo(_Model):
    code: str
    message: str
    transient: bool = False


class SessionHeader(_Model):
    """Everything about a session but its turns; stored as a Redis hash."""

    model_config = ConfigDict(extra="ignore")

    session_id: str
    agent_slug: str
    agent_hash: str
    execution_mode: Literal["synchronous", "asynchronous"] = "synchronous"
    version: int = 1
    status: Status = Status.ACTIVE
    state: State = State.READY
    drive: Drive = "manual"
    head: Literal["UserTurn", "LlmTurn", "PartialUserTurn"] | None = "UserTurn"
    created_at: float = 0.0
    updated_at: float = 0.0
    steps: int = 0
    step_limit: int = 40
    turn_count: int = 0
    #: digest chained over every stored turn (store `turn_digest`): what a cached transcript is
    #: checked against, so turns lost by Redis (failover, power cut) are never mixed with newer ones
    turns_digest: str = ""
    usage: Usage = Field(default_factory=Usage)
    error: ErrorInfo | None = None
    response: str | None = None
    #: user messages queued (`session send`) and not yet delivered: the length of the session's
    #: inbox, kept by the scripts that change it, so that a step reads the inbox only when it holds one
    inbox_waiting: int = 0
    #: the session whose sub-agent call started this one, and that call's field there
    parent: str | None = None
    parent_call: str | None = None
    #: tools a person approved for the rest of the session (`approve --for-session`): tool name ->
    #: the digest of its `parameters` schema when granted (a tool whose schema differs is not granted)
    grants: dict[str, str] = Field(default_factory=dict)
    #: the agent file's `budget` (raised by `resume --grant`): bounds the session and its sub-agents
    budget: Budget | None = None
    #: the sessions above this one, its parent first: their budgets bound it too, its spend is theirs
    ancestors: list[str] = Field(default_factory=list)
    #: those of `ancestors` that have a budget (a grant raises limits, never adds one): the only
    #: ones a step reads before its calls
    bounded_by: list[str] = Field(default_factory=list)
    #: what the session and the sessions below it spent: flat hash fields (`budget.SPENT_FIELDS`)
    #: that the scripts add to, never written whole (store/header.py)
    spent: Spend = Field(default_factory=Spend)
    #: the session and version this one was forked from (`session fork`, `session rerun`)
    forked_from: str | None = None
    forked_at: int | None = None
    #: a rerun: its calls reuse the outcomes its origin recorded (`keys.replay`)
    replays: bool = False
    #: 0 (lowest) to 9: the priority its step messages are published with
    priority: int = DEFAULT_PRIORITY
    #: a fleet limit made its model call wait (or a budget above, shared with sub-agents running at
    #: once, its next call): when it may start (seconds, Redis's clock); set by the step put back
    #: (throttle_step.lua), cleared by the next one that begins
    throttled_until: float | None = None


class VersionEntry(_Model):
    """One version of a session as `session history` lists it: what the session was at it."""

    version: int
    #: how many turns the transcript had: the transcript at this version is their prefix
    turns: int
    head: str | None
    state: str
    #: the write that made it: started, llm, tools, failed, cancelled, forked
    kind: str
    at: float
    #: what the write did, in one line
    summary: str


class ForkOrigin(_Model):
    """Where a fork came from (the view's `forked_from`)."""

    session_id: str
    version: int


class PendingCall(_Model):
    """One unfinished call, as `pending` lists it."""

    session_id: str
    call_id: str
    tool: str
    arguments: Any
    disposition: str
    reason: str | None = None
    state: str
    token: str | None = None
    created_at: float
    expires_at: float | None = None
    #: deferred calls: "approval" (a gate: approved, the tool runs under `then`) or "result" (a
    #: person supplies the result); None for calls that are not deferred
    kind: Literal["approval", "result"] | None = None
    #: a gate's disposition once approved
    then: str | None = None
    #: lowercase hex SHA-256 of the canonical {"tool", "arguments"}: what a decision is bound to
    digest: str | None = None
    #: the completions stream to XADD its completion to (`<prefix>:completions` on one Redis; the
    #: stream of the session's index shard on a Cluster)
    stream: str | None = None


class QueuedMessage(_Model):
    """A user message waiting for the session's next model call (`session send`), as views list it."""

    #: its text (cut to 500 characters)
    text: str
    #: how many attachments it carries
    media: int = 0


class SessionView(_Model):
    """The contract's session view (`start`, `step`, `resume`, `pause`, `show`, `cancel`)."""

    session_id: str
    state: State
    head: Literal["UserTurn", "LlmTurn", "PartialUserTurn"] | None
    version: int
    steps: int
    pending: list[PendingCall] = Field(default_factory=list)
    response: str | None = None
    error: ErrorInfo | None = None
    # Extensions beyond the contract's minimum:
    status: Status = Status.ACTIVE
    drive: Drive = "manual"
    agent: str = ""
    usage: Usage = Field(default_factory=Usage)
    created_at: float = 0.0
    updated_at: float = 0.0
    turns: list[dict[str, Any]] | None = None
    calls: list[dict[str, Any]] | None = None
    #: the session whose sub-agent call started this one (None for a top session)
    parent: str | None = None
    #: the child sessions this one's sub-agent calls started
    children: list[str] = Field(default_factory=list)
    #: tools approved for the rest of the session (`approve --for-session`)
    grants: list[str] = Field(default_factory=list)
    #: what the session spent, its sub-agents included
    spent: Spend = Field(default_factory=Spend)
    #: the session's limits (its own; its ancestors' bound it too)
    budget: Budget | None = None
    #: the session and version this one was forked from (None for a session started afresh)
    forked_from: ForkOrigin | None = None
    #: 0 (lowest) to 9: steps of higher-priority sessions are taken first
    priority: int = DEFAULT_PRIORITY
    #: a fleet limit (or a budget above, shared with sub-agents at once) made its next call wait
    #: until then (ISO 8601, UTC); null otherwise
    throttled_until: str | None = None
    #: user messages waiting for the next model call, oldest first
    queued: list[QueuedMessage] = Field(default_factory=list)
    #: `send` only: what became of its message, "continued" (it reopened a completed
    #: conversation) or "queued" (it waits for the next model call)
    sent: Literal["continued", "queued"] | None = None

    def spend_rows(self) -> list[tuple[BudgetKind, str, bool]]:
        """What the session spent (its sub-agents included), each kind as `show` and the page write
        it: the amount, "/limit" after it where the budget has one, and whether that limit is reached."""
        rows: list[tuple[BudgetKind, str, bool]] = []
        for kind in BUDGET_KINDS:
            spent = self.spent.amount(kind)
            limit = self.budget.limit(kind) if self.budget is not None else None
            text = f"{spent:.4g}" if kind == "costUsd" else str(int(spent))
            if limit is not None:
                text += f"/{limit:.4g}" if kind == "costUsd" else f"/{int(limit)}"
            rows.append((kind, text, limit is not None and spent >= limit))
        return rows

    def to_json(self) -> dict[str, Any]:
        data = self.model_dump(mode="json")
        for optional in ("turns", "calls", "sent"):
            if data[optional] is None:
                del data[optional]
        return data


class CompletionOutcome(_Model):
    """What `complete` reports."""

    token: str
    session_id: str
    call_id: str
    accepted: bool = True
    remaining: int
    woken: bool
    #: what the person decided: approved, edited (approved with other arguments), rejected, or
    #: responded (supplied the result: every completion of a call that is not a gate)
    decision: Literal["approved", "edited", "rejected", "responded"] | None = None
    #: set when the decision makes a call run (an approved gate, a deferred sub-agent call): the
    #: call's field, now to be published (internal: not part of the printed document)
    delegated: str | None = Field(default=None, exclude=True)
    #: the session's priority: its wake is published with it (internal)
    priority: int = Field(default=DEFAULT_PRIORITY, exclude=True)
