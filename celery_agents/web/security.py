"""Who may talk to `agents serve`, and what every answer carries.

One ASGI layer in front of every route decides, before a route runs: who the client is (the
socket peer, or what a proxy in `AGENTS_TRUSTED_PROXIES` says in `X-Forwarded-For`); the bearer
token (or the page's cookie derived from it) when `AGENTS_API_TOKEN` is set, a client past its
budget of wrong tokens having one weighed a second (`Throttle`); loopback `Host` headers only when
it is not (a page on another site cannot reach a token-less server through DNS rebinding); no
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
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from celery_agents.config import IPNetwork
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
#: wrong tokens (bearer, page cookie or login form) one client may give within `AUTH_WINDOW_S`
#: seconds; past them its tokens are weighed at most once per `ADMIT_INTERVAL_S`
AUTH_FAILURES_ALLOWED = 20
AUTH_WINDOW_S = 60.0
#: how often a throttled client has a token weighed; its other requests get 429, unweighed
ADMIT_INTERVAL_S = 1.0
#: clients remembered at once (the least recent are forgotten first): at most
#: `AUTH_FAILURES_ALLOWED` times per client in memory, about 14 MB, however addresses rotate
TRACKED_CLIENTS = 10_000
#: the shortest `AGENTS_API_TOKEN` served on an address other machines can reach
MIN_TOKEN_CHARS = 32


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
    """Without a token of `MIN_TOKEN_CHARS` or more, `serve` listens on a loopback address only."""
    if is_loopback(host):
        return
    if token is None:
        raise InvalidInput(
            f"refusing to serve on {host!r} without AGENTS_API_TOKEN: anyone who reaches it could run agents "
            "and complete calls. Set AGENTS_API_TOKEN to a long random secret, or serve on 127.0.0.1"
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise InvalidInput(
            f"refusing to serve on {host!r} with an AGENTS_API_TOKEN of {len(token)} characters: an address "
            f"others can reach needs at least {MIN_TOKEN_CHARS} (e.g. `openssl rand -hex 32`), or serve on 127.0.0.1"
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


@dataclass
class _Guesses:
    """One client's recent wrong tokens, and when it may next have a token weighed."""

    misses: deque[float]
    next_weighed: float = 0.0


class Throttle:
    """Token guesses per client, in this process. A client may give `allowed` wrong tokens within
    `window` seconds; past that budget its requests that carry a token are weighed at most once
    per `interval` and the others are answered 429 with Retry-After *without being weighed*, so a
    guesser learns nothing from them, whatever it sends. A right token from that client is
    weighed at its turn (delayed, never refused for good); a right token from any other client is
    never touched. The client is the socket peer or the address a trusted proxy names, never
    one the client writes. An IPv6 client is its /64, which one host usually holds whole. The
    `tracked` most recent clients are remembered, so rotating addresses cannot grow it."""

    def __init__(
        self,
        allowed: int = AUTH_FAILURES_ALLOWED,
        window: float = AUTH_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        tracked: int = TRACKED_CLIENTS,
        interval: float = ADMIT_INTERVAL_S,
    ) -> None:
        self.allowed, self.window, self.clock, self.tracked = allowed, window, clock, tracked
        self.interval = interval
        self._clients: OrderedDict[str, _Guesses] = OrderedDict()

    def __len__(self) -> int:
        return len(self._clients)

    def weigh(self, address: str) -> int:
        """Whether a token `address` sent may be weighed now: 0, or the seconds (Retry-After)
        before its next one is."""
        guesses = self._clients.get(_client_key(address))
        now = self.clock()
        if guesses is None or not self._over_budget(guesses, now):
            return 0
        if now >= guesses.next_weighed:
            guesses.next_weighed = now + self.interval
            return 0
        return max(1, math.ceil(guesses.next_weighed - now))

    def missed(self, address: str) -> None:
        """Count a wrong token from `address`."""
        key = _client_key(address)
        guesses = self._clients.pop(key, None) or _Guesses(deque(maxlen=self.allowed))
        self._clients[key] = guesses  # the most recent client now
        while len(self._clients) > self.tracked:
            self._clients.popitem(last=False)
        now = self.clock()
        guesses.misses.append(now)
        if self._over_budget(guesses, now):  # the budget is spent: the next token waits its turn
            guesses.next_weighed = max(guesses.next_weighed, now + self.interval)

    def _over_budget(self, guesses: _Guesses, now: float) -> bool:
        misses = guesses.misses
        return len(misses) == self.allowed and misses[0] > now - self.window


def _client_key(address: str) -> str:
    ip = _ip(address)
    if ip is None:
        return address
    return str(ipaddress.ip_network(f"{ip}/64", strict=False)) if ip.version == 6 else str(ip)


def client_address(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else ""


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An address as X-Forwarded-For or a socket peer gives it (`[::1]:80`, `10.0.0.1:5000` too)."""
    for candidate in (text, _host_of(text)):
        try:
            ip = ipaddress.ip_address(candidate.strip())
        except ValueError:
            continue
        return ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped else ip
    return None


def real_client(peer: str, forwarded_for: str, trusted: Sequence[IPNetwork]) -> str:
    """The client of a request: the socket peer, or, while the hop at hand is a trusted proxy,
    the address it appended to X-Forwarded-For, walking from the right. What a client writes
    into the header itself is never reached unless a trusted proxy vouches for it; an entry that
    is no address ends the walk at the last hop known."""
    hop = peer
    entries = forwarded_for.split(",")
    while entries and _trusted(hop, trusted):
        forwarded = _ip(entries.pop())
        if forwarded is None:
            break
        hop = str(forwarded)
    return hop


def _trusted(address: str, networks: Sequence[IPNetwork]) -> bool:
    ip = _ip(address)
    return ip is not None and any(ip in network for network in networks)


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
        f"too many wrong tokens from this address: its tokens are weighed once a second; try again in {wait} s",
        [(b"retry-after", str(wait).encode())],
    )


class Guard:
    """The ASGI layer described in the module docstring."""

    def __init__(
        self,
        app: ASGIApp,
        credentials: Credentials,
        max_body_bytes: int,
        throttle: Throttle,
        trusted_proxies: Sequence[IPNetwork] = (),
    ) -> None:
        self.app = app
        self.credentials = credentials
        self.max_body_bytes = max_body_bytes
        self.throttle = throttle
        self.trusted_proxies = tuple(trusted_proxies)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.trusted_proxies:
            self._behind_proxy(scope, headers)
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

    def _behind_proxy(self, scope: Scope, headers: dict[str, str]) -> None:
        """The client and scheme a trusted proxy names become the request's (for the throttle,
        the page's `Secure` cookies and the access log)."""
        peer = client_address(scope)
        if not _trusted(peer, self.trusted_proxies):
            return
        forwarded_for = ",".join(v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"x-forwarded-for")
        client = real_client(peer, forwarded_for, self.trusted_proxies)
        if client != peer:
            scope["client"] = (client, 0)
        proto = headers.get("x-forwarded-proto", "").rsplit(",", 1)[-1].strip().lower()
        if proto in ("http", "https"):
            scope["scheme"] = proto

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> Answer | None:
        path: str = scope["path"]
        host = headers.get("host", "")
        if not self.credentials.required and not is_loopback(_host_of(host)):
            return _json_response(
                403, "forbidden", "this server answers loopback host names only (no AGENTS_API_TOKEN)"
            )
        if scope["method"] in _UNSAFE_METHODS and _cross_site(headers, host):
            return _json_response(403, "forbidden", "requests from another site are refused")
        if path.startswith(PUBLIC_PREFIXES) or not self.credentials.required:
            return None
        cookies = _cookies(headers)
        if "authorization" in headers or cookies.get(AUTH_COOKIE):
            # A throttled client's token is weighed at its turn only: the others are not looked at.
            if wait := self.throttle.weigh(client_address(scope)):
                return too_many_guesses(wait)
            if self.credentials.allows(headers, cookies):
                return None
            self.throttle.missed(client_address(scope))
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
