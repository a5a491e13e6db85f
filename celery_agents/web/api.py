"""The `/v1` routes: each is one `celery_agents.Client` operation answering with the CLI's `--json`
document; a refusal is the contract's `{"error": {"code", "message"}}` with the status `http_status`
gives it. Handlers are plain functions: FastAPI runs them in its thread pool, where the client's
blocking Redis calls belong."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from celery_agents.client import Client
from celery_agents.errors import (
    AgentsError,
    InvalidArguments,
    InvalidInput,
    InvalidResult,
    RedisRefused,
    RedisUnavailable,
)
from celery_agents.model import Budget, SessionView, read_agent
from celery_agents.web.events import event_stream

RunMode = Literal["none", "step", "until_blocked"]
_EVENT_ID = re.compile(r"^\d{1,20}-\d{1,20}$")
#: the longest wait a request may ask for (seconds); longer work goes on, and the view says where it is
MAX_WAIT = 600.0

router = APIRouter(prefix="/v1")


def http_status(exc: AgentsError) -> int:
    """The one map from the contract's errors to HTTP: by the CLI's exit code (2 invalid input,
    3 not found, 4 wait timed out, 5 conflict), Redis out of reach 503, anything else 500."""
    if isinstance(exc, (RedisUnavailable, RedisRefused)):
        return 503
    return {2: 400, 3: 404, 4: 504, 5: 409}.get(exc.exit_code, 500)


def error_response(exc: AgentsError) -> JSONResponse:
    return JSONResponse(exc.to_json(), status_code=http_status(exc))


def client_of(request: Request) -> Client:
    client: Client = request.app.state.client
    return client


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StartBody(_Body):
    agent: dict[str, Any] = Field(description="The agent file's JSON object (model, tools, policy).")
    prompt: str = Field(description="The user's prompt (at most AGENTS_MAX_PROMPT_BYTES).")
    run: RunMode = Field("none", description="none: only create it; step: one step; until_blocked: drive it.")
    wait: bool = Field(False, description="Wait for the outcome of `run` before answering.")
    timeout: float | None = Field(None, gt=0, le=MAX_WAIT, description="Stop waiting after this many seconds (504).")
    priority: int | None = Field(
        None, ge=0, le=9, description="0 (lowest) to 9: its steps go first (default: the agent's, else 5)."
    )


class MessageBody(_Body):
    prompt: str
    run: RunMode = "none"
    interrupt: bool = Field(False, description="Cancel a model call in flight; the next one takes the message.")
    wait: bool = False
    timeout: float | None = Field(None, gt=0, le=MAX_WAIT)


class DecisionBody(_Body):
    decision: Literal["approve", "reject", "respond"] | None = Field(
        None,
        description="approve: an approval gate's call runs (with `arguments` when given: an edit); reject: it "
        "never runs, the model is told `rejected: <reason>`; respond (or no decision): `result` or `error` is "
        "the call's outcome, the tool never runs.",
    )
    result: Any = Field(None, description="respond: the tool's result, any JSON value (a string is text).")
    error: str | None = Field(None, description="respond, instead of a result: the call failed with this text.")
    arguments: Any = Field(
        None, description="approve: run with these arguments instead, a JSON object the tool's parameters take."
    )
    digest: str | None = Field(
        None, max_length=128, description="approve: refused (409 digest_mismatch) unless the pending call has it."
    )
    reason: str | None = Field(None, description="reject: why (the model is told).")
    for_session: bool = Field(False, description="approve: later calls of this tool in the session run without asking.")
    by: str | None = Field(None, max_length=200, description="Who decides (recorded).")


class ExtendBody(_Body):
    seconds: float = Field(description="The new deadline: this many seconds from now.")


class ResumeBody(_Body):
    grant: Budget | None = Field(
        None, description="Limits to add to the session's budget first: tokens, costUsd, modelCalls, toolCalls."
    )


class ForkBody(_Body):
    at: int | None = Field(None, ge=1, description="The version to fork at (default: the latest).")
    agent: dict[str, Any] | None = Field(None, description="Bind the fork to this agent file's JSON object instead.")


class RerunBody(_Body):
    from_: int = Field(alias="from", ge=1, description="The version to rerun from.")
    dry_run: bool = Field(False, description="Answer what would run and what would be reused; change nothing.")
    fresh: bool = Field(False, description="Run every tool call again, reusing nothing.")
    wait: bool = Field(False, description="Wait for the rerun's outcome before answering.")
    timeout: float | None = Field(None, gt=0, le=MAX_WAIT, description="Stop waiting after this many seconds (504).")


Wait = Annotated[bool, Query(description="Wait for the outcome before answering.")]
Timeout = Annotated[float | None, Query(gt=0, le=MAX_WAIT, description="Stop waiting after SECONDS (504).")]


def _view(view: SessionView) -> dict[str, Any]:
    return view.to_json()


@router.post("/sessions", status_code=201)
def start_session(body: StartBody, request: Request) -> dict[str, Any]:
    """Create a session from an agent and a prompt; optionally run one step or drive it."""
    spec = read_agent(body.agent, "agent")
    view = client_of(request).start(
        spec,
        body.prompt,
        step=body.run == "step",
        run=body.run == "until_blocked",
        wait=body.wait,
        timeout=body.timeout,
        priority=body.priority,
        watch=True,  # an HTTP client follows it (SSE, the page): its first answer streams too
    )
    return _view(view)


@router.get("/sessions")
def list_sessions(
    request: Request, status: str | None = None, limit: Annotated[int, Query(ge=1, le=1000)] = 50
) -> dict[str, Any]:
    """Sessions, most recently updated first; `status` keeps one state."""
    return {"sessions": [_view(v) for v in client_of(request).list(status or None, limit)]}


@router.get("/sessions/{session_id}")
def show_session(session_id: str, request: Request, detail: bool = False) -> dict[str, Any]:
    """The session view; `detail=true` adds the transcript and every call (as `show --json`)."""
    return _view(client_of(request).show(session_id, detail=detail))


@router.post("/sessions/{session_id}/step")
def step_session(session_id: str, request: Request, wait: Wait = False, timeout: Timeout = None) -> dict[str, Any]:
    """Run exactly one step."""
    return _view(client_of(request).step(session_id, wait=wait, timeout=timeout))


@router.post("/sessions/{session_id}/resume")
def resume_session(
    session_id: str, request: Request, body: ResumeBody | None = None, wait: Wait = False, timeout: Timeout = None
) -> dict[str, Any]:
    """Drive the session until it completes or only outside work remains; `grant` raises its
    budget's limits first (as `resume --grant`)."""
    grant = body.grant if body is not None else None
    return _view(client_of(request).resume(session_id, wait=wait, timeout=timeout, grant=grant))


@router.post("/sessions/{session_id}/pause")
def pause_session(session_id: str, request: Request) -> dict[str, Any]:
    """Stop driving the session (a running step finishes)."""
    return _view(client_of(request).pause(session_id))


@router.post("/sessions/{session_id}/cancel")
def cancel_session(session_id: str, request: Request) -> dict[str, Any]:
    """Stop the session for good: unfinished calls cancelled, their tokens refused."""
    return _view(client_of(request).cancel(session_id))


@router.get("/sessions/{session_id}/history")
def session_history(session_id: str, request: Request) -> dict[str, Any]:
    """Every version of the session, oldest first, with what the write that made it did."""
    return {"versions": [v.model_dump(mode="json") for v in client_of(request).history(session_id)]}


@router.post("/sessions/{session_id}/fork", status_code=201)
def fork_session(session_id: str, body: ForkBody, request: Request) -> dict[str, Any]:
    """A new session whose transcript is this one's at `at`; this one does not change."""
    spec = read_agent(body.agent, "agent") if body.agent is not None else None
    return _view(client_of(request).fork(session_id, at=body.at, agent=spec))


@router.post("/sessions/{session_id}/rerun")
def rerun_session(session_id: str, body: RerunBody, request: Request) -> JSONResponse:
    """Fork at `from` and drive the fork, reusing the origin's recorded results (unless `fresh`);
    `dry_run` answers `{"would_run", "reused"}` and changes nothing."""
    client = client_of(request)
    if body.dry_run:
        return JSONResponse(client.rerun_plan(session_id, from_version=body.from_, fresh=body.fresh))
    view = client.rerun(session_id, from_version=body.from_, fresh=body.fresh, wait=body.wait, timeout=body.timeout)
    return JSONResponse(_view(view), status_code=201)


@router.post("/sessions/{session_id}/messages")
def send_message(session_id: str, body: MessageBody, request: Request) -> dict[str, Any]:
    """Append a user message (a completed session continues the conversation; `sent` says whether
    it did or the message was queued); `interrupt` cancels a model call in flight."""
    run = body.run
    view = client_of(request).send(
        session_id,
        body.prompt,
        step=run == "step",
        run=run == "until_blocked",
        interrupt=body.interrupt,
        wait=body.wait,
        timeout=body.timeout,
    )
    return _view(view)


@router.get("/pending")
def all_pending(request: Request, limit: Annotated[int, Query(ge=1, le=10000)] = 1000) -> dict[str, Any]:
    """Unfinished calls of every session, oldest first (deferred ones with their tokens)."""
    return {"pending": [p.model_dump(mode="json") for p in client_of(request).pending(None, limit=limit)]}


@router.get("/sessions/{session_id}/pending")
def session_pending(session_id: str, request: Request) -> dict[str, Any]:
    """Unfinished calls of one session."""
    return {"pending": [p.model_dump(mode="json") for p in client_of(request).pending(session_id)]}


@router.post("/continuations/{token}")
def complete_token(token: str, body: DecisionBody, request: Request) -> dict[str, Any]:
    """Decide a deferred call: approve or reject an approval gate, or respond with its result
    (`result`, or `error` as a failure; a body with only those responds). The same operation as
    `agents session approve|reject|complete` and the completions stream: exactly one decision wins."""
    client = client_of(request)
    decision = body.decision or "respond"
    _check_fields(body, decision)
    if decision == "approve":
        if "arguments" in body.model_fields_set and body.arguments is None:
            raise InvalidArguments("the arguments must be a JSON object, not null")
        done = client.approve(
            token, arguments=body.arguments, digest=body.digest, for_session=body.for_session, by=body.by
        )
    elif decision == "reject":
        done = client.reject(token, reason=body.reason, digest=body.digest, by=body.by)
    else:
        if (body.error is None) == (body.result is None):
            raise InvalidResult('give "result" (any JSON value) or "error" (text), one of them')
        value = body.error.strip() if body.error is not None else body.result
        done = client.complete(token, value, error=body.error is not None, by=body.by)
    return done.model_dump(mode="json")


#: the body fields each decision takes (besides `decision` and `by`)
_FIELDS = {
    "approve": {"arguments", "digest", "for_session"},
    "reject": {"reason", "digest"},
    "respond": {"result", "error"},
}


def _check_fields(body: DecisionBody, decision: str) -> None:
    """A field another decision takes is refused, never ignored: a `digest` sent with a response,
    say, would otherwise look like a binding that was not checked."""
    given = {name for name in ("result", "error", "arguments", "digest", "reason") if getattr(body, name) is not None}
    extra = sorted((given | ({"for_session"} if body.for_session else set())) - _FIELDS[decision])
    if extra:
        raise InvalidInput(f"{decision} takes {', '.join(sorted(_FIELDS[decision]))} (and by), not {', '.join(extra)}")


@router.post("/continuations/{token}/extend")
def extend_token(token: str, body: ExtendBody, request: Request) -> dict[str, Any]:
    """Move a deferred call's deadline to now + `seconds`; the call as `pending` lists it (409 once
    it is decided or expired)."""
    return client_of(request).extend(token, body.seconds).model_dump(mode="json")


@router.get("/sessions/{session_id}/events", response_class=StreamingResponse)
def session_events(
    session_id: str,
    request: Request,
    last_event_id: Annotated[str | None, Header(description="Resume after this event id.")] = None,
    after: Annotated[str | None, Query(description="Resume after this event id (for clients without headers).")] = None,
) -> StreamingResponse:
    """Server-Sent Events: every event of the session from the start (or after `Last-Event-ID`),
    then new ones as they happen; the stream ends after the session completes, fails or is
    cancelled (a client that reconnects with `Last-Event-ID` hears what follows, e.g. a new message)."""
    client = client_of(request)
    sid = client.resolve(session_id)
    client.ended(sid)  # 404 before the stream starts
    start = last_event_id or after or "0-0"
    if not _EVENT_ID.match(start):
        raise InvalidInput(f"Last-Event-ID {start[:40]!r} is not an event id (<ms>-<seq>)")
    return StreamingResponse(
        event_stream(client, sid, start, request),
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
    )
