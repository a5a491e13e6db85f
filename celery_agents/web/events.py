"""Server-Sent Events from a session's event stream (the one `agents session logs --follow` reads).

Each event is `id: <stream id>` and `data: <the event as logs --json prints it>`; a client that
reconnects with `Last-Event-ID` resumes after it, from Redis, on any `serve` process. The blocking
reads run in worker threads of their own limiter, so many open streams never starve the API's
thread pool; a comment line every 15 s keeps proxies from closing a quiet stream.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from anyio.to_thread import run_sync
from starlette.requests import Request

from celery_agents.client import WATCH_RENEW_S, Client
from celery_agents.model import FINAL_EVENTS

#: how long one read waits for new events (ms): also how soon a closed stream frees its thread
BLOCK_MS = 1000
KEEPALIVE_SECONDS = 15.0
#: a browser reconnects this long after a stream ended or broke
RETRY_MS = 3000

_limiter: anyio.CapacityLimiter | None = None


def _stream_limiter() -> anyio.CapacityLimiter:
    global _limiter
    if _limiter is None:
        _limiter = anyio.CapacityLimiter(200)
    return _limiter


def sse_frame(event: dict[str, Any]) -> str:
    """One event as an SSE frame: JSON has no raw newline, so one `data:` line holds it."""
    return f"id: {event['id']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def event_stream(client: Client, session_id: str, after: str, request: Request) -> AsyncIterator[str]:
    yield f"retry: {RETRY_MS}\n\n"
    quiet_since = watched = time.monotonic()
    await run_sync(client.watch, session_id, limiter=_stream_limiter())  # its model calls stream
    while not await request.is_disconnected():
        if time.monotonic() - watched > WATCH_RENEW_S:
            await run_sync(client.watch, session_id, limiter=_stream_limiter())
            watched = time.monotonic()
        events = await run_sync(_read, client, session_id, after, limiter=_stream_limiter())
        for e in events:
            after = e["id"]
            yield sse_frame(e)
        # The session is over, not merely replaying an ending that a later message continued.
        if any(e["type"] in FINAL_EVENTS for e in events) and await run_sync(client.ended, session_id):
            return
        if events:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since > KEEPALIVE_SECONDS:
            quiet_since = time.monotonic()
            yield ": keep-alive\n\n"


def _read(client: Client, session_id: str, after: str) -> list[dict[str, Any]]:
    return client.read_events(session_id, after, block_ms=BLOCK_MS)
