"""The approvals page: server-rendered HTML (Jinja2, autoescaped) and one small script.

`/` lists the calls waiting across sessions (Approve with an optional JSON or text result, Reject
with a reason) and the sessions, filtered by agent and state; `/sessions/{id}` shows a session's
transcript, redrawn when its Server-Sent Events say something happened. Forms carry a CSRF token
(double-submit cookie); approving and rejecting are `Client.complete`, the one completion path.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader
from starlette.concurrency import run_in_threadpool

from celery_agents.client import Client
from celery_agents.errors import AgentsError, InvalidInput
from celery_agents.model import SessionView, State
from celery_agents.runtime.completions import parse_result_text
from celery_agents.web.security import (
    AUTH_COOKIE,
    CSRF_COOKIE,
    Credentials,
    Throttle,
    client_address,
    csrf_ok,
    new_csrf_token,
)

router = APIRouter(include_in_schema=False)
HERE = Path(__file__).parent
#: the most recently updated sessions the page lists (and takes its agent filter's names from)
PAGE_SESSIONS = 100
#: the oldest unfinished calls the page lists
PAGE_CALLS = 500
#: what an Approve with an empty result field records as the call's result
DEFAULT_APPROVAL: dict[str, Any] = {"approved": True}
_BACK = re.compile(r"^/(sessions/[0-9a-f]{32})?$")
_DONE = {"approved": "Approved.", "rejected": "Rejected.", "signed_out": "Signed out."}
_PROBLEMS = {
    "token_already_completed": "Someone else completed that call first: nothing was changed.",
    "token_expired": "That call's deadline passed: the model was told no result came.",
    "token_cancelled": "That call's session was cancelled.",
    "unknown_token": "That call is not known (any more).",
    "invalid_result": "That result cannot be used (empty, too large, or JSON nested too deep).",
    "csrf": "The form had expired: reload the page and try again.",
}


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts)) if ts else "—"


def _ago(ts: float | None, now: float) -> str:
    if not ts:
        return ""
    seconds = int(now - ts)
    future = seconds < 0
    seconds = abs(seconds)
    text = f"{seconds} s" if seconds < 120 else f"{seconds // 60} min" if seconds < 7200 else f"{seconds // 3600} h"
    return f"in {text}" if future else f"{text} ago"


def _pretty(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, indent=2, ensure_ascii=False)


def _arguments(value: Any) -> str:
    """A model's call arguments (JSON text as the model sent it) pretty-printed when they parse."""
    if isinstance(value, str):
        try:
            return _pretty(json.loads(value))
        except ValueError:
            return value
    return _pretty(value)


def _environment() -> Environment:
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=True)
    env.filters.update(when=_when, pretty=_pretty, arguments=_arguments, short=lambda sid: str(sid)[:8])
    env.globals.update(ago=_ago)
    return env


ENV = _environment()


def _render(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
    csrf = request.cookies.get(CSRF_COOKIE) or new_csrf_token()
    credentials: Credentials = request.app.state.credentials
    html = ENV.get_template(template).render(csrf=csrf, signed_in=credentials.required, **context)
    response = HTMLResponse(html, status_code=status)
    if request.cookies.get(CSRF_COOKIE) != csrf:
        _set_cookie(request, response, CSRF_COOKIE, csrf)
    return response


def _set_cookie(request: Request, response: Response, name: str, value: str) -> None:
    response.set_cookie(
        name,
        value,
        max_age=30 * 24 * 3600,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
    )


async def _form(request: Request) -> dict[str, str]:
    if not request.headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
        raise InvalidInput("forms are sent as application/x-www-form-urlencoded")
    fields = parse_qs((await request.body()).decode(errors="replace"), keep_blank_values=True)
    return {k: v[0] for k, v in fields.items()}


def _client(request: Request) -> Client:
    client: Client = request.app.state.client
    return client


# -- reading -----------------------------------------------------------------------------------
def _index_context(client: Client, agent: str, state: str) -> dict[str, Any]:
    pending = client.pending(None, limit=PAGE_CALLS)
    headers = client.store.headers(sorted({p.session_id for p in pending}))
    agents = {h.session_id: h.agent_slug for h in headers.values()}
    sessions = client.list(state or None, PAGE_SESSIONS)
    slugs = {*agents.values(), *(v.agent for v in sessions)}
    if state:  # the agent filter offers every recent agent, not only those in this state
        slugs |= {h.agent_slug for h in client.store.list_sessions(None, PAGE_SESSIONS)}
    if agent:
        pending = [p for p in pending if agents.get(p.session_id) == agent]
        sessions = [v for v in sessions if v.agent == agent]
    return {
        "pending": pending,
        "agents_of": agents,
        "sessions": sessions,
        "agent": agent,
        "state": state,
        "agents": sorted(slugs),
        "states": [s.value for s in State],
        "now": client.store.server_time(),
    }


@router.get("/", response_class=HTMLResponse)
async def index(request: Request, agent: str = "", state: str = "", done: str = "", problem: str = "") -> Response:
    if state and state not in {s.value for s in State}:
        state = ""
    context = await run_in_threadpool(_index_context, _client(request), agent[:200], state)
    return _render(request, "index.html", **context, done=_DONE.get(done), problem=_PROBLEMS.get(problem), back="/")


@router.get("/fragments/pending", response_class=HTMLResponse)
async def pending_fragment(request: Request, agent: str = "", state: str = "") -> Response:
    if state and state not in {s.value for s in State}:
        state = ""
    context = await run_in_threadpool(_index_context, _client(request), agent[:200], state)
    return _render(request, "_index_live.html", **context, back="/")


def _session_context(client: Client, session_id: str) -> dict[str, Any]:
    view: SessionView = client.show(session_id, detail=True)
    calls = {(c["batch"], c["call_id"]): c for c in (view.calls or [])}
    return {
        "view": view,
        "calls": calls,
        "pending": view.pending,
        "agents_of": {view.session_id: view.agent},
        "parent": getattr(view, "parent", None),
        "children": getattr(view, "children", None) or [],
        "now": client.store.server_time(),
    }


@router.get("/sessions/{session_id}", response_class=HTMLResponse)
async def session_page(request: Request, session_id: str, done: str = "", problem: str = "") -> Response:
    try:
        context = await run_in_threadpool(_session_context, _client(request), session_id)
    except AgentsError as exc:
        return problem_page(request, exc)
    back = f"/sessions/{context['view'].session_id}"
    return _render(request, "session.html", **context, done=_DONE.get(done), problem=_PROBLEMS.get(problem), back=back)


@router.get("/sessions/{session_id}/live", response_class=HTMLResponse)
async def session_fragment(request: Request, session_id: str) -> Response:
    try:
        context = await run_in_threadpool(_session_context, _client(request), session_id)
    except AgentsError as exc:
        return problem_page(request, exc)
    return _render(request, "_session_live.html", **context, back=f"/sessions/{context['view'].session_id}")


def problem_page(request: Request, exc: AgentsError) -> HTMLResponse:
    from celery_agents.web.api import http_status

    return _render(request, "problem.html", status=http_status(exc), message=exc.message, code=exc.code)


# -- deciding ----------------------------------------------------------------------------------
async def _decide(request: Request, *, approve: bool) -> Response:
    form = await _form(request)
    back = form.get("back", "/")
    back = back if _BACK.match(back) else "/"
    if not csrf_ok(request.cookies.get(CSRF_COOKIE), form.get("csrf")):
        return RedirectResponse(f"{back}?problem=csrf", status_code=303)
    token = form.get("token", "")
    try:
        if approve:
            text = form.get("result", "").strip()
            result = parse_result_text(text, _client(request).settings.max_result_bytes) if text else DEFAULT_APPROVAL
            await run_in_threadpool(_client(request).complete, token, result, by="page")
        else:
            reason = form.get("reason", "").strip() or "rejected"
            await run_in_threadpool(_client(request).complete, token, reason, error=True, by="page")
    except AgentsError as exc:
        return RedirectResponse(f"{back}?problem={exc.code}", status_code=303)
    return RedirectResponse(f"{back}?done={'approved' if approve else 'rejected'}", status_code=303)


@router.post("/approve")
async def approve(request: Request) -> Response:
    return await _decide(request, approve=True)


@router.post("/reject")
async def reject(request: Request) -> Response:
    return await _decide(request, approve=False)


# -- signing in --------------------------------------------------------------------------------
@router.get("/login", response_class=HTMLResponse)
async def login_form(request: Request) -> Response:
    return _render(request, "login.html", wrong=False)


@router.post("/login")
async def login(request: Request) -> Response:
    form = await _form(request)
    credentials: Credentials = request.app.state.credentials
    if not csrf_ok(request.cookies.get(CSRF_COOKIE), form.get("csrf")):
        return _render(request, "login.html", status=403, wrong=False, expired=True)
    if not credentials.required:
        return RedirectResponse("/", status_code=303)
    throttle: Throttle = request.app.state.throttle
    address = client_address(request.scope)
    if wait := throttle.retry_after(address):
        refused = _render(request, "login.html", status=429, wrong=False, wait=wait)
        refused.headers["retry-after"] = str(wait)
        return refused
    if not credentials.token_ok(form.get("token", "")) or credentials.cookie is None:
        throttle.failed(address)
        return _render(request, "login.html", status=401, wrong=True)
    response = RedirectResponse("/", status_code=303)
    _set_cookie(request, response, AUTH_COOKIE, credentials.cookie)
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    form = await _form(request)
    if not csrf_ok(request.cookies.get(CSRF_COOKIE), form.get("csrf")):
        return RedirectResponse("/?problem=csrf", status_code=303)
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(AUTH_COOKIE, path="/")
    return response
