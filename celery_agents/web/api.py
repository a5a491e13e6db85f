"""The `/v1` routes: each is one `celery_agents.Client` operation answering with the CLI's `--json`
document; a refusal is the contract's `{"error": {"code", "message"}}` with the status `http_status`
gives it. Handlers are plain functions: FastAPI runs them in its thread pool, where the client's
blocking Redis calls belong."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import redis
from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from celery_agents.client import Client
from celery_agents.errors import AgentsError, InvalidInput, InvalidResult, RedisUnavailable
from celery_agents.model import SessionView, parse_agent
from celery_agents.web.events import event_stream

RunMode = Literal["none", "step", "until_blocked"]
_EVENT_ID = re.compile(r"^\d{1,20}-\d{1,20}$")
#: the longest wait a request may ask for (seconds); longer work goes on, and the view says where it is
MAX_WAIT = 600.0

router = APIRouter(prefix="/v1")


def http_status(exc: AgentsError) -> int:
    """The one map from the contract's errors to HTTP: by the CLI's exit code (2 invalid input,
    3 not found, 4 wait timed out, 5 conflict), Redis out of reach 503, anything else 500."""
    if isinstance(exc, RedisUnavailable):
        return 503
    return {2: 400, 3: 404, 4: 504, 5: 409}.get(exc.exit_code, 500)


def error_response(exc: AgentsError) -> JSONResponse:
    return JSONResponse(exc.to_json(), status_code=http_status(exc))


def redis_error_response(exc: redis.RedisError) -> JSONResponse:
    return error_response(RedisUnavailable(f"cannot reach Redis: {exc}"))


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


class MessageBody(_Body):
    prompt: str
    run: RunMode = "none"
    wait: bool = False
    timeout: float | None = Field(None, gt=0, le=MAX_WAIT)


class CompleteBody(_Body):
    result: Any = Field(None, description="The tool's result: any JSON value (a string is text).")
    error: str | None = Field(None, description="Instead of a result: the call failed with this text.")
    by: str | None = Field(None, max_length=200, description="Who completes it (recorded).")


Wait = Annotated[bool, Query(description="Wait for the outcome before answering.")]
Timeout = Annotated[float | None, Query(gt=0, le=MAX_WAIT, description="Stop waiting after SECONDS (504).")]


def _view(view: SessionView) -> dict[str, Any]:
    return view.to_json()


@router.post("/sessions", status_code=201)
def start_session(body: StartBody, request: Request) -> dict[str, Any]:
    """Create a session from an agent and a prompt; optionally run one step or drive it."""
    spec = parse_agent(body.agent, "agent")
    view = client_of(request).start(
        spec,
        body.prompt,
        step=body.run == "step",
        run=body.run == "until_blocked",
        wait=body.wait,
        timeout=body.timeout,
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
def resume_session(session_id: str, request: Request, wait: Wait = False, timeout: Timeout = None) -> dict[str, Any]:
    """Drive the session until it completes or only outside work remains."""
    return _view(client_of(request).resume(session_id, wait=wait, timeout=timeout))


@router.post("/sessions/{session_id}/pause")
def pause_session(session_id: str, request: Request) -> dict[str, Any]:
    """Stop driving the session (a running step finishes)."""
    return _view(client_of(request).pause(session_id))


@router.post("/sessions/{session_id}/cancel")
def cancel_session(session_id: str, request: Request) -> dict[str, Any]:
    """Stop the session for good: unfinished calls cancelled, their tokens refused."""
    return _view(client_of(request).cancel(session_id))


@router.post("/sessions/{session_id}/messages")
def send_message(session_id: str, body: MessageBody, request: Request) -> dict[str, Any]:
    """Append a user message (a completed session continues the conversation)."""
    run = body.run
    view = client_of(request).send(
        session_id, body.prompt, step=run == "step", run=run == "until_blocked", wait=body.wait, timeout=body.timeout
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
def complete_token(token: str, body: CompleteBody, request: Request) -> dict[str, Any]:
    """Complete a deferred call with its result, or with `error` as a failure. The same operation
    as `agents session complete` and the completions stream: exactly one completion wins."""
    from celery_agents.cli.prompt import check_token_shape

    check_token_shape(token)
    if (body.error is None) == (body.result is None):
        raise InvalidResult('give "result" (any JSON value) or "error" (text), one of them')
    value = body.error.strip() if body.error is not None else body.result
    outcome = client_of(request).complete(token, value, error=body.error is not None, by=body.by)
    return outcome.model_dump(mode="json")


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
    client.store.header(sid)  # 404 before the stream starts
    start = last_event_id or after or "0-0"
    if not _EVENT_ID.match(start):
        raise InvalidInput(f"Last-Event-ID {start[:40]!r} is not an event id (<ms>-<seq>)")
    return StreamingResponse(
        event_stream(client.store, sid, start, request),
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
    )
