"""What the state machine needs from the outside world, as small protocols.

The runtime binds them to litellm, the tool runners, Redis journals and the real clock; tests bind
them to scripted fakes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from celery_agents.model import AgentSpec, CallOutcome, ErrorInfo, LlmTurn, TrackedCall, Usage

#: what a streamed piece of an answer is: its text or its reasoning
DeltaKind = Literal["text", "reasoning"]


class LiveOutput(Protocol):
    """Where a model answer goes while it streams, and how the call learns it is interrupted.

    The port batches what arrives and calls `write` from the step's thread, at most every
    `interval` seconds (or sooner once `max_chars` are waiting), and once more when the answer is
    whole; nothing written is the answer (the committed turn is)."""

    #: the longest a piece of the answer waits before it is written (s)
    interval: float
    #: written sooner once this many characters wait
    max_chars: int
    #: someone follows the session's events: the answer streams (else it is asked for whole)
    watched: bool

    def start(self) -> None:
        """An answer starts (again, after a failed attempt): what follows is written from its start."""

    def write(self, parts: list[tuple[DeltaKind, str]]) -> None:
        """Write pieces of the answer, in the order they came."""

    def interrupted(self) -> bool:
        """A message sent with `--interrupt` arrived that this call does not include."""

    def on_interrupt(self, wake: Callable[[], None]) -> None:
        """Call `wake` (from any thread) when `interrupted` becomes true."""


@dataclass(frozen=True)
class LlmRequest:
    """One model call: the OpenAI-shaped messages and tool schemas, plus the agent's settings."""

    agent: AgentSpec
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    #: identifies the call for journaling: (session, version) of the step that makes it
    session_id: str = ""
    version: int = 0
    #: where the answer streams to (None: nothing listens, the answer is asked for whole)
    live: LiveOutput | None = field(default=None, compare=False)


class LlmFailure(Exception):
    """The model call failed for good in this step; `transient` says whether a later retry may work.
    `retry_after`: the provider refused the call for now (429) and said when to ask again
    (seconds), for `model`; the runtime then pauses that model for the whole fleet."""

    def __init__(
        self, code: str, message: str, *, transient: bool, retry_after: float | None = None, model: str = ""
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.transient = transient
        self.retry_after = retry_after
        self.model = model


class LlmInterrupted(Exception):
    """The model call was cancelled by a message sent with `--interrupt`: its partial answer is
    dropped; `usage` is what it spent (as reported, or estimated from what arrived)."""

    code = "interrupted"

    def __init__(self, usage: Usage, *, model: str = "", chars: int = 0, called: bool = True) -> None:
        super().__init__("the model call was interrupted by a new message")
        self.usage = usage
        self.model = model
        #: characters of the answer that had arrived (and are dropped)
        self.chars = chars
        #: the model was asked (False: the interrupt came before the call started)
        self.called = called


class LlmPort(Protocol):
    def complete(self, request: LlmRequest) -> LlmTurn: ...


class ToolPort(Protocol):
    def run(self, agent: AgentSpec, session_id: str, call: TrackedCall) -> CallOutcome: ...


class Clock(Protocol):
    def now(self) -> float: ...


class Ids(Protocol):
    def token(self, session_id: str) -> str: ...

    def call_id(self) -> str: ...


@dataclass(frozen=True)
class BudgetClaim:
    """What claiming calls on the budgets of the sessions above this one gave: `granted` of them
    may start (a model call: 0 or 1); fewer than asked, `refusal` is the `budget_exceeded` error
    of the limit that stopped the rest."""

    granted: int
    refusal: ErrorInfo | None = None


class BudgetPort(Protocol):
    """The budgets of the sessions above this one (a sub-agent's ancestors), which sibling
    sub-agents spend at the same time: a call is claimed on them, atomically, just before it
    starts. A claim that must wait for the calls of other sessions in flight does not return: the
    runtime puts the step back (runtime/budget.py)."""

    def claim_model(self, request: LlmRequest) -> BudgetClaim: ...

    def claim_tools(self, count: int) -> BudgetClaim: ...


class NoBudgetAbove:
    """No session above has a budget: every call may start."""

    def claim_model(self, request: LlmRequest) -> BudgetClaim:
        return BudgetClaim(1)

    def claim_tools(self, count: int) -> BudgetClaim:
        return BudgetClaim(count)


@dataclass
class Ports:
    llm: LlmPort
    tools: ToolPort
    clock: Clock
    ids: Ids
    budget: BudgetPort = field(default_factory=NoBudgetAbove)
