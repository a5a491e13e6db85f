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

from celery_agents.errors import BudgetExceeded
from celery_agents.model import (
    AgentSpec,
    CallMeta,
    CallOutcome,
    CallState,
    ErrorInfo,
    EventType,
    LlmTurn,
    Media,
    SessionHeader,
    Spend,
    State,
    Status,
    ToolCall,
    ToolResponse,
    TrackedCall,
    Usage,
    UserQuery,
    UserTurn,
    arguments_not_an_object,
    call_digest,
    child_session_id,
)
from celery_agents.model.budget import MODEL_KINDS, TOOL_KINDS, BudgetScope, Pricing
from celery_agents.model.policy import disposition_for
from celery_agents.scheduler.budget import over_budget
from celery_agents.scheduler.messages import build_messages
from celery_agents.scheduler.ports import BudgetClaim, LlmFailure, LlmInterrupted, LlmRequest, Ports


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
    #: the limits and spend of the session and of each session above it that has a budget
    budgets: list[BudgetScope] = field(default_factory=list)
    #: a rerun's recorded outcomes by call digest (tool and arguments): a call the origin ran
    #: takes its outcome instead of running (`session rerun`; empty otherwise)
    recorded: dict[str, CallOutcome] = field(default_factory=dict)


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
    #: what the step spent (its model call, the tool calls it started), added by its commit
    spend: Spend = field(default_factory=Spend)

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
        media = [Media.model_validate(m) for m in call.meta.media or []]
        return ToolResponse(call_id=call.call_id, tool=call.tool, content=call.result, media=media)
    if call.state == CallState.EXPIRED and call.then is not None:
        text = "expired: no decision arrived before the deadline, and the call did not run."
        if call.reason:
            text += f" (It was waiting for: {call.reason}.)"
        return ToolResponse(call_id=call.call_id, tool=call.tool, content=text, is_error=True)
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
    over = over_budget(snap.budgets, MODEL_KINDS, own=h.session_id)
    if over is not None:
        stopped = _fail("llm", over, head_before, prefix)
        stopped.counts_as_step = False
        return stopped
    turns = [*snap.turns, *prefix]
    request = LlmRequest(
        agent=snap.agent,
        messages=build_messages(snap.agent, turns),
        tools=snap.agent.tool_schemas(),
        session_id=h.session_id,
        version=h.version,
    )
    claim = ports.budget.claim_model(request)  # the budgets above, which siblings spend at once
    if not claim.granted:
        stopped = _fail("llm", _refusal(claim), head_before, prefix)
        stopped.counts_as_step = False
        return stopped
    try:
        turn = ports.llm.complete(request)
    except LlmInterrupted as exc:
        return _interrupted(h, prefix, head_before, exc, snap.agent.pricing)
    except LlmFailure as exc:
        failed = _fail(
            "llm", ErrorInfo(code=exc.code, message=exc.message, transient=exc.transient), head_before, prefix
        )
        failed.spend = Spend(model_calls=1)
        return failed
    turn = _normalise_call_ids(turn, ports)
    if snap.agent.pricing is not None:  # the agent file's prices, not litellm's
        turn = turn.model_copy(update={"usage": snap.agent.pricing.priced(turn.usage)})
    spend = model_spend(turn.usage)
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
            spend=spend,
        )
    return Transition(
        kind="llm",
        new_turns=[*prefix, turn],
        head="LlmTurn",
        state=State.TOOLS,
        usage=turn.usage,
        events=[event],
        spend=spend,
    )


def _interrupted(
    h: SessionHeader,
    prefix: list[UserTurn | LlmTurn],
    head_before: str | None,
    exc: LlmInterrupted,
    pricing: Pricing | None,
) -> Transition:
    """A message sent with `--interrupt` cancelled the model call: nothing of its answer is kept,
    what it spent is counted (at the agent file's `pricing` when it gives one), and the session is
    ready for a model call that includes the message (the commit finds it queued). The turns the
    call was given (results, messages) are kept."""
    usage = pricing.priced(exc.usage) if pricing is not None and exc.called else exc.usage
    spend = model_spend(usage) if exc.called else Spend()
    event = Event(
        EventType.MODEL_INTERRUPTED,
        {"model": exc.model, "dropped_chars": exc.chars, "usage": usage.model_dump(exclude_defaults=True)},
    )
    return Transition(
        kind="interrupted",
        new_turns=prefix,
        head="UserTurn" if prefix else head_before,
        state=State.READY,
        usage=usage,
        events=[event],
        counts_as_step=exc.called,
        spend=spend,
    )


def model_spend(usage: Usage) -> Spend:
    """What one model call spent: its tokens (prompt and completion) and its cost where known."""
    tokens = usage.total_tokens or usage.prompt_tokens + usage.completion_tokens
    return Spend(tokens=tokens, cost_usd=usage.cost or 0.0, model_calls=1)


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
    started, over = _within_budget(snap, calls, now, ports)
    if over is not None:  # a gate refused by the budget asks nobody: its token is never made
        asked = {c.call_id for c in calls if c.token}
        events = [e for e in events if e.type != EventType.TOKEN_CREATED or e.data.get("call_id") in asked]
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
        t = Transition(
            kind="tools",
            new_turns=[responses_turn(calls, ports.clock.now())],
            calls=calls,
            head="UserTurn",
            state=State.READY,
            events=events,
        )
    else:
        t = Transition(
            kind="tools", calls=calls, dispatch=dispatch, head="PartialUserTurn", state=State.WAITING, events=events
        )
    t.spend = Spend(tool_calls=started)
    if over is not None:
        # Stopped by its budget: the calls within it ran (or were dispatched), the others are
        # answered with an error and never run; the session fails, resumable with a grant.
        t.state, t.status, t.error = State.FAILED, Status.FAILED, over
        t.events.append(Event(EventType.FAILED, {"code": over.code, "message": over.message}))
    return t


def _starts(call: TrackedCall) -> bool:
    """The call runs a tool now (inline, or dispatched: a sub-agent call starts a session), or
    once a person approves it (a gate: it is counted when asked, never again when it runs)."""
    if call.state == CallState.DEFERRED:
        return call.then is not None
    return call.state == CallState.RUNNING or (call.disposition == "runSync" and call.state == CallState.READY)


def _within_budget(snap: Snapshot, calls: list[TrackedCall], now: float, ports: Ports) -> tuple[int, ErrorInfo | None]:
    """Check the budget before the calls that would start, in the model's call order: the
    session's own (read with it), then the budgets above it (claimed through the port, against
    what siblings have in flight). The calls from the first one refused on are failed in `calls`
    (never run). Returns how many start and the refusal, if any."""
    starting = [i for i, call in enumerate(calls) if _starts(call)]
    allowed, over = len(starting), None
    for n in range(len(starting)):
        over = over_budget(snap.budgets, TOOL_KINDS, Spend(tool_calls=n), own=snap.header.session_id)
        if over is not None:
            allowed = n
            break
    if allowed:
        claim = ports.budget.claim_tools(allowed)
        if claim.granted < allowed:
            allowed, over = claim.granted, _refusal(claim)
    for i in starting[allowed:]:
        text = f"not run: {over.message if over else 'budget exceeded'}"
        unasked = calls[i].model_copy(update={"token": None, "expires_at": None})
        calls[i] = _finish(unasked, CallOutcome(state="failed", attempts=0, error=text), now)
    return allowed, over


def _refusal(claim: BudgetClaim) -> ErrorInfo:
    """The error of a claim that did not grant all it was asked."""
    return claim.refusal or ErrorInfo(code=BudgetExceeded.code, message="budget exceeded")


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
    args, arg_error = _parse_arguments(tc.name, tc.arguments)
    disp = disposition_for(agent, tc.name, args if arg_error is None else None)
    if disp.then is not None and granted(snap.header.grants, agent, tc.name):
        disp = disp.then  # approved for the rest of the session: runs as approved gates run
    call = TrackedCall(
        call_id=tc.id,
        tool=tc.name,
        arguments=args,
        raw_arguments=tc.arguments,
        batch=len(snap.turns) - 1,
        position=position,
        disposition=disp.tag,
        then=disp.then.tag if disp.then is not None else None,
        reason=disp.reason,
        created_at=now,
    )
    if position >= agent.max_tool_calls_per_turn:
        return _finish(call, CallOutcome(state="failed", attempts=0, error=_too_many(turn, agent)), now), None
    if agent.sub_agent(tc.name) is not None:
        # A delegation names its child session now: an id derived from the call (one child per call).
        # Deferred, it is an approval gate whose `then` starts that child.
        arg_error = arg_error or _prompt_error(args)
        update: dict[str, Any] = {"meta": CallMeta(child=child_session_id(snap.header.session_id, call.field))}
        if disp.tag == "defer":
            update["then"] = "runAsync"
        call = call.model_copy(update=update)
    elif agent.tool(tc.name) is None:
        return _finish(call, CallOutcome(state="failed", attempts=0, error=agent.no_tool_named(tc.name)), now), None
    if arg_error is not None:
        return _finish(call, CallOutcome(state="failed", attempts=0, error=arg_error), now), None
    recorded = snap.recorded.get(call.digest())
    if recorded is not None:
        # A rerun: the origin ran this very call (same tool, same arguments); its outcome is reused
        # whatever the disposition, so nothing runs twice and nobody is asked twice.
        reused = _finish(call.model_copy(update={"meta": CallMeta()}), recorded, now)
        return reused, Event(
            EventType.TOOL_FINISHED,
            {"call_id": call.call_id, "tool": call.tool, "state": reused.state.value, "reused": True},
        )
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


def rebound_call(agent: AgentSpec, session_id: str, call: TrackedCall, now: float, token: str) -> TrackedCall:
    """An unfinished call copied into a fork bound to `agent`, as that agent would have tracked
    it: the disposition its policy gives the call (never the one the origin's agent gave), a new
    wait behind `token` when deferred, dispatched when it runs on its own lane, a child of the
    fork's for a sub-agent. Not run (failed, and the model is told) when `agent` has no such tool
    or runs it inline: the step that runs inline calls was the origin's."""
    disp = disposition_for(agent, call.tool, call.arguments)
    update: dict[str, Any] = {
        "disposition": disp.tag,
        "then": disp.then.tag if disp.then is not None else None,
        "reason": disp.reason,
        "token": None,
        "expires_at": None,
    }
    delegation = agent.sub_agent(call.tool) is not None
    if delegation:
        update["meta"] = call.meta | CallMeta(child=child_session_id(session_id, call.field))
        if disp.tag == "defer":
            update["then"] = "runAsync"
    elif agent.tool(call.tool) is None:
        failed = CallOutcome(state="failed", attempts=0, error=agent.no_tool_named(call.tool))
        return _finish(call.model_copy(update=update), failed, now)
    if disp.tag == "defer":
        timeout = disp.timeout_seconds or agent.defer_timeout_seconds
        update.update(state=CallState.DEFERRED, token=token, expires_at=now + timeout)
    elif disp.tag in ("runAsync", "runIsolated") or delegation:
        update.update(state=CallState.RUNNING)
    else:
        why = (
            f"not run: the agent of this fork runs {call.tool} in its step ({disp.tag}), and that step "
            "was its origin's; ask again for it if it is still needed"
        )
        return _finish(call.model_copy(update=update), CallOutcome(state="failed", attempts=0, error=why), now)
    return call.model_copy(update=update)


def granted(grants: dict[str, str], agent: AgentSpec, tool_name: str) -> bool:
    """A person approved `tool_name` for the rest of the session, and its schema is the one they saw."""
    tool = agent.tool(tool_name)
    digest = grants.get(tool_name)
    return digest is not None and tool is not None and digest == schema_digest(tool.parameters)


def schema_digest(parameters: dict[str, Any]) -> str:
    """What a grant is bound to: the tool's `parameters` schema (canonical JSON, SHA-256)."""
    return call_digest("", parameters)


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
    meta = call.meta | outcome.stored_meta()
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
