"""Sorting model-call failures into transient (retry later) and permanent (fix something first)."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Classified:
    code: str
    transient: bool
    message: str
    retry_after: float | None = None


# Checked most specific first: litellm's exception classes subclass one another.
_BY_CLASS: tuple[tuple[str, str, bool], ...] = (
    ("ContextWindowExceededError", "context_window_exceeded", False),
    ("ContentPolicyViolationError", "content_policy", False),
    ("AuthenticationError", "auth_error", False),
    ("PermissionDeniedError", "permission_denied", False),
    ("NotFoundError", "model_not_found", False),
    ("BudgetExceededError", "budget_exceeded", False),
    ("UnsupportedParamsError", "bad_request", False),
    ("RateLimitError", "rate_limited", True),
    ("Timeout", "timeout", True),
    ("APIConnectionError", "connection_error", True),
    ("ServiceUnavailableError", "server_error", True),
    ("BadGatewayError", "server_error", True),
    ("InternalServerError", "server_error", True),
    ("UnprocessableEntityError", "bad_request", False),
    ("BadRequestError", "bad_request", False),
)


def _retry_after(exc: BaseException) -> float | None:
    # The OpenAI SDK's errors carry the reply's headers on their response; litellm's own HTTP
    # handler's, as `litellm_response_headers` only.
    headers = getattr(getattr(exc, "response", None), "headers", None) or getattr(exc, "litellm_response_headers", None)
    if not headers or not hasattr(headers, "get"):
        return None
    raw = headers.get("retry-after") or headers.get("Retry-After")
    if raw is None:
        return None
    try:
        return max(0.0, float(raw))
    except (TypeError, ValueError):
        return None


#: what litellm puts before an OpenAI-compatible server's error
_PROVIDER_SAID = "OpenAIException - "


def provider_message(message: str, status: object) -> str:
    """An OpenAI-compatible server's error as the OpenAI SDK words it: litellm's own HTTP handler
    quotes the reply's JSON body whole, the SDK gives its `error.message` (or its top-level
    `message`), else `Error code: <status>`. So a failure reads the same on both routes
    (`llm/adapter.py`, `HTTP_ROUTE_VARIABLE`); the SDK never leaves JSON there, so its own wording
    passes unchanged."""
    head, said, body = message.partition(_PROVIDER_SAID)
    if not said or not body.startswith("{"):
        return message
    try:
        data = json.loads(body)
    except ValueError:
        return message
    if not isinstance(data, dict):
        return message
    inner = data.get("error", data)
    text = inner.get("message") if isinstance(inner, dict) else None
    return head + said + (text if isinstance(text, str) and text else f"Error code: {status}")


def classify(exc: BaseException) -> Classified:
    """Name a failure of `litellm.completion` and say whether retrying later may help."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    message = provider_message(str(exc).strip(), getattr(exc, "status_code", None)) or type(exc).__name__
    for cls_name, code, transient in _BY_CLASS:
        if cls_name in names:
            return Classified(code, transient, message, _retry_after(exc))
    status = getattr(exc, "status_code", None)
    if isinstance(status, int):
        if status == 429 or status >= 500 or status == 408:
            return Classified("server_error" if status >= 500 else "rate_limited", True, message, _retry_after(exc))
        if 400 <= status < 500:
            return Classified("bad_request", False, message)
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return Classified("connection_error", True, message)
    return Classified("llm_error", False, message)
