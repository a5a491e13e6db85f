"""The named failures of celery-agents.

Every error a user can meet is one of these: each carries the contract's error code and the CLI's
exit code, so the CLI maps them to output in one place and a library user can catch them by name.
"""

from __future__ import annotations

from typing import Any


class AgentsError(Exception):
    """Base of every celery-agents error; `code` is the contract's error code."""

    code = "internal_error"
    exit_code = 1

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            body["details"] = self.details
        return {"error": body}


class InvalidInput(AgentsError):
    """A command was used wrongly (missing prompt, bad option value)."""

    code = "invalid_input"
    exit_code = 2


class InvalidAgentFile(InvalidInput):
    """The agent file cannot be used; the message names the file, the field and the fix."""

    code = "invalid_agent_file"


class InvalidResult(InvalidInput):
    """A tool result handed to `complete` cannot be used (empty file, unreadable)."""

    code = "invalid_result"


class InvalidEntry(InvalidInput):
    """A completions stream entry that is not text (its bytes are not UTF-8)."""

    code = "invalid_entry"


class InvalidArguments(InvalidInput):
    """Arguments given with an approval (an edit) do not validate against the tool's schema."""

    code = "invalid_arguments"


class UnknownSession(AgentsError):
    code = "unknown_session"
    exit_code = 3


class UnknownToken(AgentsError):
    code = "unknown_token"
    exit_code = 3


class UnknownLimit(AgentsError):
    """`limits delete` of a KEY under which no limit is set."""

    code = "unknown_limit"
    exit_code = 3


class TokenConflict(AgentsError):
    """The token exists but can no longer be completed."""

    exit_code = 5


class TokenAlreadyCompleted(TokenConflict):
    code = "token_already_completed"


class TokenExpired(TokenConflict):
    code = "token_expired"


class TokenCancelled(TokenConflict):
    code = "token_cancelled"


class NotAnApproval(TokenConflict):
    """approve or reject of a deferred call that is not an approval gate (a person supplies its
    result: complete it)."""

    code = "not_an_approval"


class DigestMismatch(TokenConflict):
    """The decision was made on another call than the one pending (`--digest`)."""

    code = "digest_mismatch"


class SessionNotAdvanceable(AgentsError):
    """The session is cancelled, failed, completed or otherwise cannot take this command."""

    code = "session_not_advanceable"
    exit_code = 5


class BudgetExceeded(AgentsError):
    """A session (or one above it) reached a limit of its `budget`: the session failed before the
    call that would have passed it; `session resume --grant` raises the limit and goes on. The
    session's `error` carries this code."""

    code = "budget_exceeded"
    exit_code = 5


class UntrustedSpec(AgentsError):
    """AGENTS_SPEC_KEY is set and a session's stored agent spec is not signed with it: nothing of
    that spec runs (no tool, no model call)."""

    code = "untrusted_agent_spec"
    exit_code = 5


class RedisUnavailable(AgentsError):
    """Redis cannot be reached (refused, timed out, still loading its data)."""

    code = "redis_unavailable"
    exit_code = 1


class RedisRefused(AgentsError):
    """Redis answered a command with an error (out of memory, a read-only replica, a script's
    error). Not an outage: waiting for Redis to come back does not help."""

    code = "redis_unavailable"
    exit_code = 1


class IncompatibleData(RedisRefused):
    """The Redis holds celery-agents data of a stored format this release does not read."""


class BrokerMissing(AgentsError):
    """Sessions live on a Redis Cluster and no `AGENTS_BROKER_URL` names where the queues live."""

    code = "broker_missing"
    exit_code = 2


class WaitTimeout(AgentsError):
    """The wait for workers ran out; the work itself goes on."""

    code = "wait_timeout"
    exit_code = 4


TOKEN_ERRORS: dict[str, type[AgentsError]] = {
    "unknown": UnknownToken,
    "completed": TokenAlreadyCompleted,
    "expired": TokenExpired,
    "cancelled": TokenCancelled,
    "not_an_approval": NotAnApproval,
    "digest_mismatch": DigestMismatch,
}
