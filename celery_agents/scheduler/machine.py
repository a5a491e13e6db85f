"""The step state machine: given a session and what has happened, the next transition.

Pure: everything outside (model, tools, ids, clock) comes through `Ports`, and the result is a
`Transition` value that the runtime commits atomically. The table of design.md "One step":

- head `UserTurn`: call the model, append an `LlmTurn`; no tool calls means completed.
- head `LlmTurn` with tool calls: classify each call by policy, run `runSync` calls inline in call
  order, dispatch `runAsync`/`runIsolated`, create a token for each `defer`. All final: `UserTurn`;
  otherwise `PartialUserTurn`.
- head `PartialUserTurn`: unfinished calls remain: nothing to do; all final: `UserTurn`, then the
  model is called in the same step.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from celery_agents.model import (
    AgentSpec,
    CallState,
    ErrorInfo,
    EventType,
    LlmTurn,
    Media,
    SessionHeader,
    State,
    Status,
    ToolCall,
    ToolResponse,
    TrackedCall,
    Usage,
    UserQuery,
    UserTurn,
    arguments_not_an_object,
    child_session_id,
)
from celery_agents.scheduler.messages import build_messages
from celery_agents.scheduler.policy import disposition_for
from celery_agents.scheduler.ports import CallOutcome, LlmFailure, LlmRequest, Ports


@dataclass
class Snapshot:
    """What a step reads: the header, the agent, the stored turns and the newest batch's calls."""

    header: SessionHeader
    agent: AgentSpec
    turns: list[UserTurn | LlmTurn]
    #: the newest batch's calls with their outcomes; only a step at head `PartialUserTurn` reads
    #: them (the store loads them only then)
    calls: list[TrackedCall] = field(default_factory=list)
    #: user messages sent meanwhile, oldest first: the next model call delivers them
    inbox: list[UserQuery] = field(default_factory=list)


@dataclass
class Event:
    type: EventType
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Transition:
    """What one step decided. `commit` is False when there is nothing to write (`wait`)."""

    kind: str
    commit: bool = True
    new_turns: list[UserTurn | LlmTurn] = field(default_factory=list)
    #: calls to write to the ledger (new, or changed by this step)
    calls: list[TrackedCall] = field(default_factory=list)
    #: calls to hand to the tools / isolated queues once the commit is done
    dispatch: list[TrackedCall] = field(default_factory=list)
    head: str | None = None
    state: State = State.READY
    status: Status = Status.ACTIVE
    response: str | None = None
    error: ErrorInfo | None = None
    usage: Usage = field(default_factory=Usage)
    events: list[Event] = field(default_factory=list)
    #: the step counts against the session's step limit
    counts_as_step: bool = True
    #: how many of the oldest queued user messages this step delivered (its commit removes them)
    inbox_taken: int = 0

    @property
    def unfinished(self) -> list[TrackedCall]:
        return [c for c in self.calls if not c.state.final]


def advance(snap: Snapshot, ports: Ports) -> Transition:
    """Decide and perform one step of the session in `snap`."""
    h = snap.header
    if h.head == "UserTurn":
        return _call_model(snap, ports, folded=None)
    if h.head == "LlmTurn":
        last = snap.turns[-1]
        assert isinstance(last, LlmTurn), "head LlmTurn but the newest stored turn is not one"
        if not last.tool_calls:
            if snap.inbox:  # a follow-up message continues the conversation
                return _call_model(snap, ports, folded=None)
            return Transition(
                kind="noop",
                commit=False,
                head="LlmTurn",
                state=State.COMPLETED,
                status=Status.COMPLETED,
                response=last.text,
            )
        return _run_tools(snap, last, ports)
    if h.head == "PartialUserTurn":
        unfinished = [c for c in snap.calls if not c.state.final]
        if unfinished:
            return Transition(kind="wait", commit=False, head="PartialUserTurn", state=State.WAITING)
        return _call_model(snap, ports, folded=responses_turn(snap.calls, ports.clock.now()))
    return Transition(kind="noop", commit=False, head=h.head, state=h.state, status=h.status)


def responses_turn(calls: list[TrackedCall], now: float) -> UserTurn:
    """The `UserTurn` answering a finished batch: one response per call, in the model's call order."""
    ordered = sorted(calls, key=lambda c: c.position)
    return UserTurn(tool_responses=[response_for(c) for c in ordered], at=now)


def response_for(call: TrackedCall) -> ToolResponse:
    """What the model is told about a final call."""
    if call.state == CallState.COMPLETED:
        media = [Media.model_validate(m) for m in call.meta.get("media", [])]
        return ToolResponse(call_id=call.call_id, tool=call.tool, content=call.result, media=media)
    if call.state == CallState.EXPIRED:
        text = "No result arrived before the deadline: the call expired and its result will not come."
        if call.reason:
            text += f" (It was waiting for: {call.reason}.)"
        return ToolResponse(call_id=call.call_id, tool=call.tool, content=text, is_error=True)
    if call.state == CallState.CANCELLED:
        return ToolResponse(
            call_id=call.call_id, tool=call.tool, content="The call was cancelled before it finished.", is_error=True
        )
    return ToolResponse(call_id=call.call_id, tool=call.tool, content=call.error or "the tool failed", is_error=True)


def _fail(
    kind: str, error: ErrorInfo, head: str | None, new_turns: list[UserTurn | LlmTurn] | None = None
) -> Transition:
    return Transition(
        kind=kind,
        new_turns=new_turns or [],
        head=head,
        state=State.FAILED,
        status=Status.FAILED,
        error=error,
        events=[Event(EventType.FAILED, {"code": error.code, "message": error.message})],
    )


def _call_model(snap: Snapshot, ports: Ports, folded: UserTurn | None) -> Transition:
    """Call the model on the transcript plus `folded` (the answers to the last batch of calls) and
    the queued user messages, which follow the answers, each its own user turn, in the order sent."""
    t = _call_model_on(snap, ports, folded)
    t.inbox_taken = len(snap.inbox)
    return t


def _call_model_on(snap: Snapshot, ports: Ports, folded: UserTurn | None) -> Transition:
    h = snap.header
    prefix: list[UserTurn | LlmTurn] = [folded] if folded is not None else []
    prefix += [UserTurn(query=q, at=ports.clock.now()) for q in snap.inbox]
    head_before = "UserTurn" if prefix else h.head
    if h.steps >= h.step_limit:
        err = ErrorInfo(
            code="max_steps",
            message=(
                f"the session reached its step limit ({h.step_limit} steps, maxSteps of the agent file); "
                "`session resume` grants another maxSteps steps"
            ),
        )
        refused = _fail("llm", err, head_before, prefix)
        refused.counts_as_step = False  # no model call was made: the limit is not spent on the refusal
        return refused
    turns = [*snap.turns, *prefix]
    request = LlmRequest(
        agent=snap.agent,
        messages=build_messages(snap.agent, turns),
        tools=snap.agent.tool_schemas(),
        session_id=h.session_id,
        version=h.version,
    )
    try:
        turn = ports.llm.complete(request)
    except LlmFailure as exc:
        return _fail("llm", ErrorInfo(code=exc.code, message=exc.message, transient=exc.transient), head_before, prefix)
    turn = _normalise_call_ids(turn, ports)
    event = Event(
        EventType.LLM_CALLED,
        {
            "model": turn.model,
            "tool_calls": len(turn.tool_calls),
            "usage": turn.usage.model_dump(exclude_defaults=True),
        },
    )
    if not turn.tool_calls:
        return Transition(
            kind="llm",
            new_turns=[*prefix, turn],
            head="LlmTurn",
            state=State.COMPLETED,
            status=Status.COMPLETED,
            response=turn.text or "",
            usage=turn.usage,
            events=[event, Event(EventType.COMPLETED, {})],
        )
    return Transition(
        kind="llm", new_turns=[*prefix, turn], head="LlmTurn", state=State.TOOLS, usage=turn.usage, events=[event]
    )


#: a call id the model sends is kept when it looks like this (what providers make, and what may go
#: into a tool's environment); any other gets a fresh id, used in the transcript from then on
_CALL_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def _normalise_call_ids(turn: LlmTurn, ports: Ports) -> LlmTurn:
    """Every call gets a usable id unique within the turn (some models repeat, omit or mangle them)."""
    seen: set[str] = set()
    fixed: list[ToolCall] = []
    changed = False
    for c in turn.tool_calls:
        cid = c.id if _CALL_ID.match(c.id) else ports.ids.call_id()
        suffix = len(seen)
        while cid in seen:
            suffix += 1
            cid = f"{c.id if _CALL_ID.match(c.id) else 'call'}_{suffix}"
        if cid != c.id:
            changed = True
        seen.add(cid)
        fixed.append(c if cid == c.id else c.model_copy(update={"id": cid}))
    return turn.model_copy(update={"tool_calls": fixed}) if changed else turn


def _parse_arguments(tool: str, raw: str) -> tuple[Any, str | None]:
    if not raw.strip():
        return {}, None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        return raw, f"the arguments are not valid JSON ({exc.msg} at character {exc.pos}); send a JSON object"
    if not isinstance(value, dict):
        return value, arguments_not_an_object(tool)
    return value, None


def _run_tools(snap: Snapshot, turn: LlmTurn, ports: Ports) -> Transition:
    now = ports.clock.now()
    calls: list[TrackedCall] = []
    events: list[Event] = []
    for position in range(len(turn.tool_calls)):
        call, event = _track(snap, turn, position, now, ports)
        calls.append(call)
        if event is not None:
            events.append(event)
    # runSync calls run inline, in the model's call order.
    for i, call in enumerate(calls):
        if call.disposition == "runSync" and call.state == CallState.READY:
            calls[i] = _run_inline(snap, call, ports)
            events.append(
                Event(
                    EventType.TOOL_FINISHED,
                    {
                        "call_id": call.call_id,
                        "tool": call.tool,
                        "state": calls[i].state.value,
                        "duration_ms": calls[i].duration_ms,
                    },
                )
            )
    dispatch = [c for c in calls if c.state == CallState.RUNNING]
    if all(c.state.final for c in calls):
        return Transition(
            kind="tools",
            new_turns=[responses_turn(calls, ports.clock.now())],
            calls=calls,
            head="UserTurn",
            state=State.READY,
            events=events,
        )
    return Transition(
        kind="tools", calls=calls, dispatch=dispatch, head="PartialUserTurn", state=State.WAITING, events=events
    )


def _prompt_error(args: Any) -> str | None:
    """What is wrong with a sub-agent call's arguments, if anything."""
    prompt = args.get("prompt") if isinstance(args, dict) else None
    if not isinstance(prompt, str) or not prompt.strip():
        return 'give the task as {"prompt": "..."}, a non-empty string'
    return None


def _track(snap: Snapshot, turn: LlmTurn, position: int, now: float, ports: Ports) -> tuple[TrackedCall, Event | None]:
    """The tracked call for the model's call at `position`, as its disposition leaves it: failed at
    once (too many calls, no such tool, bad arguments), deferred behind a token, dispatched, or
    ready to run inline; and the event that says so."""
    agent, tc = snap.agent, turn.tool_calls[position]
    disp = disposition_for(agent, tc.name)
    args, arg_error = _parse_arguments(tc.name, tc.arguments)
    call = TrackedCall(
        call_id=tc.id,
        tool=tc.name,
        arguments=args,
        raw_arguments=tc.arguments,
        batch=len(snap.turns) - 1,
        position=position,
        disposition=disp.tag,
        reason=disp.reason,
        created_at=now,
    )
    if position >= agent.max_tool_calls_per_turn:
        return _finish(call, CallOutcome(state="failed", attempts=0, error=_too_many(turn, agent)), now), None
    if agent.sub_agent(tc.name) is not None:
        # A delegation names its child session now: an id derived from the call (one child per call).
        arg_error = arg_error or _prompt_error(args)
        call = call.model_copy(update={"meta": {"child": child_session_id(snap.header.session_id, call.field)}})
    elif agent.tool(tc.name) is None:
        return _finish(call, CallOutcome(state="failed", attempts=0, error=agent.no_tool_named(tc.name)), now), None
    if arg_error is not None:
        return _finish(call, CallOutcome(state="failed", attempts=0, error=arg_error), now), None
    if disp.tag == "defer":
        timeout = disp.timeout_seconds or agent.defer_timeout_seconds
        token = ports.ids.token(snap.header.session_id)
        call = call.model_copy(update={"state": CallState.DEFERRED, "token": token, "expires_at": now + timeout})
        return call, Event(
            EventType.TOKEN_CREATED, {"call_id": call.call_id, "tool": call.tool, "reason": call.reason or ""}
        )
    if disp.tag in ("runAsync", "runIsolated"):
        call = call.model_copy(update={"state": CallState.RUNNING})
        return call, Event(
            EventType.TOOL_DISPATCHED, {"call_id": call.call_id, "tool": call.tool, "disposition": disp.tag}
        )
    return call, None


def _run_inline(snap: Snapshot, call: TrackedCall, ports: Ports) -> TrackedCall:
    """Run a runSync call now; the call with its outcome."""
    started = ports.clock.now()
    call = call.model_copy(update={"started_at": started})
    outcome = ports.tools.run(snap.agent, snap.header.session_id, call)
    return _finish(call, outcome, ports.clock.now())


def _too_many(turn: LlmTurn, agent: AgentSpec) -> str:
    limit = agent.max_tool_calls_per_turn
    return (
        f"not run: the response asked for {len(turn.tool_calls)} tool calls and only the first {limit} run "
        f"(maxToolCallsPerTurn of the agent); ask again for this one if it is still needed"
    )


def _finish(call: TrackedCall, outcome: CallOutcome, now: float) -> TrackedCall:
    state = outcome.call_state
    meta = {**call.meta, **outcome.stored_meta()}
    return call.model_copy(
        update={
            "state": state,
            "result": outcome.result if state == CallState.COMPLETED else None,
            "error": outcome.error if state == CallState.FAILED else None,
            "finished_at": now,
            "duration_ms": outcome.duration_ms,
            "exit_status": outcome.exit_status,
            "attempts": outcome.attempts,
            "meta": meta,
        }
    )
