"""Scripted stand-ins for the scheduler's ports: a model, tools, a clock and ids, all recording."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

from celery_agents.model import (
    AgentSpec,
    CallOutcome,
    LlmTurn,
    SessionHeader,
    ToolCall,
    TrackedCall,
    Usage,
    UserQuery,
    UserTurn,
)
from celery_agents.scheduler import LlmFailure, LlmRequest, Ports, Snapshot
from celery_agents.tools.resolve import parse_agent


class ScriptedLlm:
    """Answers with the scripted turns (or raises the scripted failures), in order; counts calls."""

    def __init__(self, *replies: LlmTurn | LlmFailure) -> None:
        self.replies = list(replies)
        self.requests: list[LlmRequest] = []
        self._lock = threading.Lock()

    @property
    def calls(self) -> int:
        return len(self.requests)

    def complete(self, request: LlmRequest) -> LlmTurn:
        with self._lock:
            self.requests.append(request)
            if not self.replies:
                raise AssertionError("the model was called more often than the test scripted")
            reply = self.replies.pop(0)
        if isinstance(reply, LlmFailure):
            raise reply
        return reply


Outcome = CallOutcome | Callable[[TrackedCall], CallOutcome]


class RecordingTools:
    """Runs a call by tool name: a scripted outcome, or `completed` with `"<tool> ok"`."""

    def __init__(self, outcomes: dict[str, Outcome] | None = None) -> None:
        self.outcomes = outcomes or {}
        self.runs: list[TrackedCall] = []
        self._lock = threading.Lock()

    @property
    def ran(self) -> list[str]:
        return [c.call_id for c in self.runs]

    def run(self, agent: AgentSpec, session_id: str, call: TrackedCall) -> CallOutcome:
        with self._lock:
            self.runs.append(call)
        outcome = self.outcomes.get(call.tool)
        if outcome is None:
            return CallOutcome(state="completed", result=f"{call.tool} ok")
        return outcome(call) if callable(outcome) else outcome


class TickingClock:
    """Starts at `start` and moves one second forward at every reading."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def now(self) -> float:
        self.t += 1.0
        return self.t


class CountingIds:
    def __init__(self) -> None:
        self._n = itertools.count(1)

    def token(self, session_id: str) -> str:
        return f"{session_id}.secret-token-{next(self._n):06d}"

    def call_id(self) -> str:
        return f"generated_{next(self._n)}"


def ports(
    llm: ScriptedLlm | None = None, tools: RecordingTools | None = None, clock: TickingClock | None = None
) -> Ports:
    return Ports(
        llm=llm or ScriptedLlm(),
        tools=tools or RecordingTools(),
        clock=clock or TickingClock(),
        ids=CountingIds(),
    )


EMPTY: dict[str, Any] = {"type": "object", "properties": {}}


def make_agent(policy: dict[str, Any] | None = None, **extra: Any) -> AgentSpec:
    """An agent with one tool of each kind and a policy that gives each disposition a tool."""
    data: dict[str, Any] = {
        "slug": "test",
        "model": "fake/model",
        "systemPrompt": "You are a test.",
        "tools": [
            {"name": "sync_a", "command": ["echo"]},
            {"name": "sync_b", "python": "tests.x:y", "parameters": EMPTY},
            {"name": "async_t", "python": "tests.x:y", "parameters": EMPTY},
            {"name": "isolated_t", "command": ["echo"]},
            {"name": "defer_t", "python": "tests.x:y", "parameters": EMPTY},
            {"name": "external_t", "external": True},
        ],
        "toolCallPolicy": policy
        if policy is not None
        else {
            "default": "runSync",
            "rules": [
                {"tool": "async_t", "disposition": "runAsync"},
                {"tool": "isolated_t", "disposition": {"tag": "runIsolated"}},
                {"tool": "defer_t", "disposition": {"tag": "defer", "reason": "a human approves"}},
            ],
        },
    }
    data.update(extra)
    return parse_agent(data)


def llm_turn(*calls: tuple[str, str, str] | ToolCall, text: str | None = None, **extra: Any) -> LlmTurn:
    """An `LlmTurn` asking for `(id, name, arguments)` calls."""
    tool_calls = [c if isinstance(c, ToolCall) else ToolCall(id=c[0], name=c[1], arguments=c[2]) for c in calls]
    extra.setdefault("usage", Usage(prompt_tokens=10, completion_tokens=2, total_tokens=12))
    extra.setdefault("model", "fake/model")
    return LlmTurn(text=text, tool_calls=tool_calls, **extra)


def header(head: str | None, *, steps: int = 0, step_limit: int = 40, version: int = 1) -> SessionHeader:
    return SessionHeader(
        session_id="sess1",
        agent_slug="test",
        agent_hash="h",
        version=version,
        head=head,  # type: ignore[arg-type]
        steps=steps,
        step_limit=step_limit,
    )


def snapshot(
    agent: AgentSpec,
    turns: list[UserTurn | LlmTurn],
    *,
    partial: bool = False,
    calls: list[TrackedCall] | None = None,
    steps: int = 0,
    step_limit: int = 40,
) -> Snapshot:
    head = "PartialUserTurn" if partial else turns[-1].kind
    return Snapshot(
        header=header(head, steps=steps, step_limit=step_limit), agent=agent, turns=turns, calls=calls or []
    )


def ask(text: str = "What is the weather in Paris?") -> UserTurn:
    return UserTurn(query=UserQuery(text=text), at=1.0)
