"""Who may talk to `agents serve`, and what every answer carries.

One ASGI layer in front of every route decides, before a route runs: the bearer token (or the
page's cookie derived from it) when `AGENTS_API_TOKEN` is set; loopback `Host` headers only when it
is not (a page on another site cannot reach a token-less server through DNS rebinding); no
state-changing request from another site; request bodies bounded. Every answer gets a strict
Content-Security-Policy (no inline script, nothing from another origin) and its neighbours.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import math
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

from celery_agents.errors import InvalidInput

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

AUTH_COOKIE = "agents_auth"
CSRF_COOKIE = "agents_csrf"
#: paths anyone may fetch: the login form and the page's own static files
PUBLIC_PREFIXES = ("/login", "/static/", "/docs-assets/")
#: paths that answer programs (JSON errors); every other path is the page (redirect to /login)
API_PREFIXES = ("/v1/", "/metrics", "/openapi.json")

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
# Swagger UI sets inline styles; it still runs no inline script and loads nothing from elsewhere.
DOCS_CSP = CSP.replace("style-src 'self'", "style-src 'self' 'unsafe-inline'")
SECURITY_HEADERS = {
    "x-content-type-options": "nosniff",
    # same-origin, not no-referrer: with no-referrer a browser sends `Origin: null` on its own forms
    "referrer-policy": "same-origin",
    "x-frame-options": "DENY",
    "cross-origin-opener-policy": "same-origin",
    "cross-origin-resource-policy": "same-origin",
}
_UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: wrong tokens (bearer, page cookie or login form) one client address may give within
#: `AUTH_WINDOW_S` seconds; then it is answered 429 until the oldest of them is that old
AUTH_FAILURES_ALLOWED = 20
AUTH_WINDOW_S = 60.0
#: client addresses whose failures are remembered at once (the least recent are forgotten first)
_TRACKED_ADDRESSES = 10_000


def is_loopback(host: str) -> bool:
    """`localhost` or a loopback IP literal (127.0.0.0/8, ::1)."""
    host = host.strip().strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Without a token, `serve` listens on a loopback address only."""
    if token is None and not is_loopback(host):
        raise InvalidInput(
            f"refusing to serve on {host!r} without AGENTS_API_TOKEN: anyone who reaches it could run agents "
            "and complete calls. Set AGENTS_API_TOKEN to a long random secret, or serve on 127.0.0.1"
        )


def _host_of(header: str) -> str:
    """The host part of a `Host` header (`[::1]:8765` → `::1`)."""
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Credentials:
    """The API token, and the page cookie derived from it (the cookie never holds the token)."""

    def __init__(self, token: str | None) -> None:
        self.token = token
        self.cookie = hmac.new(token.encode(), b"celery-agents page", hashlib.sha256).hexdigest() if token else None

    @property
    def required(self) -> bool:
        return self.token is not None

    def token_ok(self, given: str) -> bool:
        return self.token is not None and hmac.compare_digest(given.encode(), self.token.encode())

    def allows(self, headers: dict[str, str], cookies: dict[str, str]) -> bool:
        if self.token is None:
            return True
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and self.token_ok(given.strip()):
            return True
        cookie = cookies.get(AUTH_COOKIE, "")
        return bool(cookie) and self.cookie is not None and hmac.compare_digest(cookie.encode(), self.cookie.encode())


class Throttle:
    """Wrong tokens per client address within a sliding window, in this process: guessing the
    token is refused (429) after `allowed` failures, whatever the next guess is, so the answers
    stop telling a right token from a wrong one. Behind a proxy every client shares its address:
    the lock-out then covers them all for at most `window` seconds."""

    def __init__(
        self,
        allowed: int = AUTH_FAILURES_ALLOWED,
        window: float = AUTH_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.allowed, self.window, self.clock = allowed, window, clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def retry_after(self, address: str) -> int:
        """Seconds until `address` may try again (0: now)."""
        failures = self._failures.get(address)
        if failures is None or len(failures) < self.allowed:
            return 0
        wait = failures[0] + self.window - self.clock()
        return math.ceil(wait) if wait > 0 else 0

    def failed(self, address: str) -> None:
        failures = self._failures.pop(address, None) or deque(maxlen=self.allowed)
        failures.append(self.clock())
        self._failures[address] = failures
        while len(self._failures) > _TRACKED_ADDRESSES:
            self._failures.popitem(last=False)


def client_address(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else ""


def new_csrf_token() -> str:
    return secrets.token_urlsafe(32)


def csrf_ok(cookie: str | None, submitted: str | None) -> bool:
    """Double-submit: the form's hidden field equals the page's SameSite=Strict cookie. Any
    number of `serve` processes agree without sharing a secret."""
    return bool(cookie) and bool(submitted) and hmac.compare_digest(str(cookie).encode(), str(submitted).encode())


Answer = tuple[int, list[tuple[bytes, bytes]], bytes]


def _json_response(status: int, code: str, message: str, extra: list[tuple[bytes, bytes]] | None = None) -> Answer:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return status, headers + (extra or []), body


def too_many_guesses(wait: int) -> Answer:
    return _json_response(
        429,
        "too_many_requests",
        f"too many wrong tokens from this address: try again in {wait} s",
        [(b"retry-after", str(wait).encode())],
    )


class Guard:
    """The ASGI layer described in the module docstring."""

    def __init__(self, app: ASGIApp, credentials: Credentials, max_body_bytes: int, throttle: Throttle) -> None:
        self.app = app
        self.credentials = credentials
        self.max_body_bytes = max_body_bytes
        self.throttle = throttle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self._refusal(scope, headers)
        if refusal is None and scope["method"] in _UNSAFE_METHODS:
            body, refusal = await self._read_body(headers, receive)
            if refusal is None:
                receive = _replay(body, receive)
        if refusal is not None:
            await _answer(send, *refusal, path=scope["path"])
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                _add_headers(message, scope["path"])
            await send(message)

        await self.app(scope, receive, send_with_headers)

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> Answer | None:
        path: str = scope["path"]
        host = headers.get("host", "")
        if not self.credentials.required and not is_loopback(_host_of(host)):
            return _json_response(
                403, "forbidden", "this server answers loopback host names only (no AGENTS_API_TOKEN)"
            )
        if scope["method"] in _UNSAFE_METHODS and _cross_site(headers, host):
            return _json_response(403, "forbidden", "requests from another site are refused")
        if path.startswith(PUBLIC_PREFIXES):
            return None
        cookies = _cookies(headers)
        address = client_address(scope)
        if self.credentials.required and (wait := self.throttle.retry_after(address)):
            return too_many_guesses(wait)
        if self.credentials.allows(headers, cookies):
            return None
        if "authorization" in headers or cookies.get(AUTH_COOKIE):
            self.throttle.failed(address)
        if path.startswith(API_PREFIXES) or "text/html" not in headers.get("accept", ""):
            return _json_response(
                401,
                "unauthorized",
                "give Authorization: Bearer <AGENTS_API_TOKEN>",
                [(b"www-authenticate", b'Bearer realm="celery-agents"')],
            )
        return 303, [(b"location", b"/login"), (b"content-length", b"0")], b""

    async def _read_body(self, headers: dict[str, str], receive: Receive) -> tuple[bytes, Answer | None]:
        too_big = _json_response(413, "invalid_input", f"the request body is larger than {self.max_body_bytes} bytes")
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return b"", too_big
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return b"", too_big
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks), None


def _cross_site(headers: dict[str, str], host: str) -> bool:
    """A browser says where a request comes from: another site may not change anything here."""
    if headers.get("sec-fetch-site") == "cross-site":
        return True
    origin = headers.get("origin")
    if origin is None:
        return False
    return origin == "null" or urlsplit(origin).netloc.lower() != host.lower()


def _cookies(headers: dict[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in headers.get("cookie", "").split(";"):
        name, sep, value = part.strip().partition("=")
        if sep:
            out.setdefault(name, value)
    return out


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _add_headers(message: Message, path: str) -> None:
    have = {k.lower() for k, _ in message.get("headers", [])}
    extra = dict(SECURITY_HEADERS)
    extra["content-security-policy"] = DOCS_CSP if path == "/docs" else CSP
    message["headers"] = list(message.get("headers", [])) + [
        (k.encode(), v.encode()) for k, v in extra.items() if k.encode() not in have
    ]


async def _answer(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes, *, path: str) -> None:
    start: Message = {"type": "http.response.start", "status": status, "headers": headers}
    _add_headers(start, path)
    await send(start)
    await send({"type": "http.response.body", "body": body})
