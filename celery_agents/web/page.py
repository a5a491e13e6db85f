"""The approvals page: server-rendered HTML (Jinja2, autoescaped) and one small script.

`/` lists the calls waiting across sessions and the sessions, filtered by agent and state;
`/sessions/{id}` shows a session's transcript, redrawn when its Server-Sent Events say something
happened, with Pause, Resume and Cancel. An approval gate offers Approve and run, Edit arguments
and run, and Reject with a reason, each bound to the digest the page showed; a plain deferred call
offers Approve (with an optional JSON or text result) and Reject; both can have their deadline
extended. Forms carry a CSRF token (double-submit cookie); every decision is the `Client`'s, as on
the command line.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader
from starlette.concurrency import run_in_threadpool

from celery_agents.client import Client
from celery_agents.errors import AgentsError, InvalidArguments, InvalidInput
from celery_agents.model import SessionView, State
from celery_agents.model.limits import UnusableJson, load_json
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
#: what the page's Extend button adds to a deferred call's deadline
EXTEND_SECONDS = 3600
_DONE = {
    "approved": "Approved.",
    "rejected": "Rejected.",
    "signed_out": "Signed out.",
    "run": "Approved: the call runs now.",
    "edited": "Approved with your arguments: the call runs now.",
    "extended": "The deadline is an hour later.",
    "paused": "Paused: no further step is taken until you resume it.",
    "resumed": "Resumed.",
    "cancelled": "Cancelled.",
    "forked": "Forked: this is the new session.",
}
_PROBLEMS = {
    "token_already_completed": "Someone else completed that call first: nothing was changed.",
    "token_expired": "That call's deadline passed: the model was told no result came.",
    "token_cancelled": "That call's session was cancelled.",
    "unknown_token": "That call is not known (any more).",
    "invalid_result": "That result cannot be used (empty, too large, or JSON nested too deep).",
    "csrf": "The form had expired: reload the page and try again.",
    "digest_mismatch": "That call is not the one the page showed you: nothing was run. Look at it again.",
    "not_an_approval": "That call is not an approval gate: a person gives its result (Approve with a result).",
    "invalid_arguments": "Those arguments are not a JSON object the tool takes: nothing was run.",
    "session_not_advanceable": "That session has ended: it cannot do that any more.",
    "invalid_input": "That request could not be used.",
}
#: the session page's buttons, and what each says once done
_SESSION_DONE = {"pause": "paused", "resume": "resumed", "cancel": "cancelled"}


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


def _left(seconds: float) -> str:
    """Time left before a deadline, as the page's countdown words it (page.js `left`)."""
    s = int(seconds)
    if s <= 0:
        return "deadline passed"
    if s < 3600:
        return f"{s // 60} min {s % 60} s left"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60} min left"
    return f"{s // 86400} d {s % 86400 // 3600} h left"


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
    env.globals.update(ago=_ago, left=_left)
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
    agents = client.agent_slugs([p.session_id for p in pending])
    sessions = client.list(state or None, PAGE_SESSIONS)
    slugs = {*agents.values(), *(v.agent for v in sessions)}
    if state:  # the agent filter offers every recent agent, not only those in this state
        slugs |= {v.agent for v in client.list(None, PAGE_SESSIONS)}
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
        "now": client.now(),
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
        "now": client.now(),
        # "Fork from here" on a turn forks at the last version whose transcript ends with it.
        "fork_at": {v.turns: v.version for v in client.history(view.session_id)},
        "forked_from": view.forked_from,
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
async def _checked_form(request: Request) -> tuple[dict[str, str], str, bool]:
    """The form's fields, the page to go back to (one of ours), and whether its CSRF token holds."""
    form = await _form(request)
    back = form.get("back", "/")
    back = back if _BACK.match(back) else "/"
    return form, back, csrf_ok(request.cookies.get(CSRF_COOKIE), form.get("csrf"))


def _back(back: str, what: str, code: str) -> RedirectResponse:
    """Back to the page the form was on, saying what was `done` or what the `problem` was."""
    return RedirectResponse(f"{back}?{what}={code}", status_code=303)


async def _respond(request: Request, *, approve: bool) -> Response:
    """A plain deferred call: the person gives its result (Approve) or its error (Reject)."""
    form, back, fresh = await _checked_form(request)
    if not fresh:
        return _back(back, "problem", "csrf")
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
        return _back(back, "problem", exc.code)
    return _back(back, "done", "approved" if approve else "rejected")


@router.post("/approve")
async def approve(request: Request) -> Response:
    return await _respond(request, approve=True)


@router.post("/reject")
async def reject(request: Request) -> Response:
    return await _respond(request, approve=False)


@router.post("/gates/approve")
async def approve_gate(request: Request) -> Response:
    """Approve and run (no `arguments` field), or Edit arguments and run: bound to the digest the
    page showed, so a call that is not the one shown is refused, not approved."""
    form, back, fresh = await _checked_form(request)
    if not fresh:
        return _back(back, "problem", "csrf")
    client, token, edited = _client(request), form.get("token", ""), form.get("arguments")
    try:
        arguments = None if edited is None else _edited_arguments(edited)
        done = await run_in_threadpool(
            functools.partial(
                client.approve,
                token,
                arguments=arguments,
                digest=form.get("digest") or None,
                for_session=form.get("for_session") == "1",
                by="page",
            )
        )
    except InvalidArguments as exc:
        if edited is None:
            return _back(back, "problem", exc.code)
        # The page again, saying what does not fit, with the person's text kept in the editor.
        return await _again(request, back, f"Nothing was run: {exc.message}", {token: edited})
    except AgentsError as exc:
        return _back(back, "problem", exc.code)
    return _back(back, "done", "edited" if done.decision == "edited" else "run")


def _edited_arguments(text: str) -> Any:
    """The editor's text as JSON (page.js checks it before posting; a script-less browser may not)."""
    try:
        return load_json(text)
    except (json.JSONDecodeError, UnusableJson) as exc:
        raise InvalidArguments(f"the arguments are not JSON: {exc}") from None


async def _again(request: Request, back: str, message: str, kept: dict[str, str]) -> Response:
    client = _client(request)
    if back == "/":
        context = await run_in_threadpool(_index_context, client, "", "")
        return _render(request, "index.html", 400, **context, problem=message, kept=kept, back=back)
    context = await run_in_threadpool(_session_context, client, back.rsplit("/", 1)[1])
    return _render(request, "session.html", 400, **context, problem=message, kept=kept, back=back)


@router.post("/gates/reject")
async def reject_gate(request: Request) -> Response:
    """Reject an approval gate: it never runs; the model is told `rejected: <reason>`. Bound to
    the digest the page showed, as an approval is."""
    form, back, fresh = await _checked_form(request)
    if not fresh:
        return _back(back, "problem", "csrf")
    reason = form.get("reason", "").strip() or None
    token, digest = form.get("token", ""), form.get("digest") or None
    reject = functools.partial(_client(request).reject, token, reason=reason, digest=digest, by="page")
    try:
        await run_in_threadpool(reject)
    except AgentsError as exc:
        return _back(back, "problem", exc.code)
    return _back(back, "done", "rejected")


@router.post("/extend")
async def extend(request: Request) -> Response:
    """The deadline of a deferred call an hour later than it is (never sooner)."""
    form, back, fresh = await _checked_form(request)
    if not fresh:
        return _back(back, "problem", "csrf")
    try:
        await run_in_threadpool(_extend_by, _client(request), form.get("token", ""), EXTEND_SECONDS)
    except AgentsError as exc:
        return _back(back, "problem", exc.code)
    return _back(back, "done", "extended")


def _extend_by(client: Client, token: str, seconds: float) -> None:
    """`extend` sets the deadline to now + N: N is what is left plus `seconds`. A token that is not
    pending gets its refusal from `extend` itself (decided, expired, cancelled, unknown)."""
    left = 0.0
    with contextlib.suppress(AgentsError):
        shown = [p for p in client.pending(token.partition(".")[0]) if p.token == token]
        if shown and shown[0].expires_at:
            left = max(0.0, shown[0].expires_at - client.now())
    client.extend(token, left + seconds)


def _session_action(action: str) -> Any:
    async def act(request: Request, session_id: str) -> Response:
        _, back, fresh = await _checked_form(request)
        if not fresh:
            return _back(back, "problem", "csrf")
        client = _client(request)
        operations: dict[str, Callable[[str], SessionView]] = {
            "pause": client.pause,
            "resume": functools.partial(client.resume, wait=False),
            "cancel": client.cancel,
        }
        operation = operations[action]
        try:
            view = await run_in_threadpool(operation, session_id)
        except AgentsError as exc:
            return _back(back, "problem", exc.code)
        return _back(f"/sessions/{view.session_id}", "done", _SESSION_DONE[action])

    act.__name__ = f"{action}_session"
    return act


for _action in _SESSION_DONE:
    router.post(f"/sessions/{{session_id}}/{_action}")(_session_action(_action))


@router.post("/fork")
async def fork(request: Request) -> Response:
    """ "Fork from here": a new session whose transcript ends at the turn chosen; the page shows it."""
    form = await _form(request)
    back = form.get("back", "/")
    back = back if _BACK.match(back) else "/"
    if not csrf_ok(request.cookies.get(CSRF_COOKIE), form.get("csrf")):
        return RedirectResponse(f"{back}?problem=csrf", status_code=303)
    try:
        at = int(form.get("at", ""))
        view = await run_in_threadpool(_client(request).fork, form.get("session_id", ""), at=at)
    except ValueError:
        return RedirectResponse(f"{back}?problem=invalid_input", status_code=303)
    except AgentsError as exc:
        return RedirectResponse(f"{back}?problem={exc.code}", status_code=303)
    return RedirectResponse(f"/sessions/{view.session_id}?done=forked", status_code=303)


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
    if wait := throttle.weigh(client_address(request.scope)):  # not weighed: not its turn
        refused = _render(request, "login.html", status=429, wrong=False, wait=wait)
        refused.headers["retry-after"] = str(wait)
        return refused
    if not credentials.token_ok(form.get("token", "")) or credentials.cookie is None:
        throttle.missed(client_address(request.scope))
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
