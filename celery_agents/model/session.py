"""The session header and the user-facing views of a session and its pending calls."""

from __future__ import annotations

import hashlib
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

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
    attempt to start it (a redelivered message, a worker after a crash) names the same session."""
    return hashlib.sha256(f"child:{parent_id}:{call_field}".encode()).hexdigest()[:32]


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

    def to_json(self) -> dict[str, Any]:
        data = self.model_dump(mode="json")
        for optional in ("turns", "calls"):
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
    #: set when the completion approved a deferred sub-agent call: the call's field, now to be
    #: published so that it starts its child session (internal: not part of the printed document)
    delegated: str | None = Field(default=None, exclude=True)
