"""What the state machine needs from the outside world, as small protocols.

The runtime binds them to litellm, the tool runners, Redis journals and the real clock; tests bind
them to scripted fakes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from celery_agents.model import AgentSpec, CallState, LlmTurn, Media, OutcomeState, TrackedCall


@dataclass(frozen=True)
class LlmRequest:
    """One model call: the OpenAI-shaped messages and tool schemas, plus the agent's settings."""

    agent: AgentSpec
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    #: identifies the call for journaling: (session, version) of the step that makes it
    session_id: str = ""
    version: int = 0


class LlmFailure(Exception):
    """The model call failed for good in this step; `transient` says whether a later retry may work."""

    def __init__(self, code: str, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.transient = transient


class LlmPort(Protocol):
    def complete(self, request: LlmRequest) -> LlmTurn: ...


@dataclass
class CallOutcome:
    """What executing one tool call produced."""

    state: OutcomeState
    result: Any = None
    error: str | None = None
    duration_ms: float | None = None
    exit_status: int | None = None
    attempts: int = 1
    media: list[Media] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def call_state(self) -> CallState:
        return CallState(self.state)

    def stored_meta(self) -> dict[str, Any]:
        """`meta` as a call stores it: with the media the tool returned under `media`."""
        meta = dict(self.meta)
        if self.media:
            meta["media"] = [m.model_dump() for m in self.media]
        return meta


class ToolPort(Protocol):
    def run(self, agent: AgentSpec, session_id: str, call: TrackedCall) -> CallOutcome: ...


class Clock(Protocol):
    def now(self) -> float: ...


class Ids(Protocol):
    def token(self, session_id: str) -> str: ...

    def call_id(self) -> str: ...


@dataclass
class Ports:
    llm: LlmPort
    tools: ToolPort
    clock: Clock
    ids: Ids
