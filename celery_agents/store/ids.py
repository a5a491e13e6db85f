"""Session ids and continuation tokens: how they are made and what a valid one looks like."""

from __future__ import annotations

import re
import secrets
import uuid

from celery_agents.errors import UnknownSession, UnknownToken

SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


_SECRET = re.compile(r"^[A-Za-z0-9_-]{16,128}$")


def new_session_id() -> str:
    return uuid.uuid4().hex


def new_token(session_id: str) -> str:
    """A continuation token: the session id, a dot, and 144 random bits."""
    return f"{session_id}.{secrets.token_urlsafe(18)}"


def parse_token(token: str) -> tuple[str, str]:
    sid, dot, secret = token.strip().partition(".")
    if not dot or not SESSION_ID.match(sid) or not _SECRET.match(secret):
        raise UnknownToken(f"unknown token {token.strip()[:80]!r}: it is not a token this system made", token=token)
    return sid, secret


def check_session_id(session_id: str) -> str:
    if not SESSION_ID.match(session_id):
        raise UnknownSession(f"unknown session {session_id[:80]!r}", session_id=session_id)
    return session_id
