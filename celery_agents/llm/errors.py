"""Sorting model-call failures into transient (retry later) and permanent (fix something first)."""

from __future__ import annotations

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
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    if not headers:
        return None
    raw = headers.get("retry-after") or headers.get("Retry-After")
    if raw is None:
        return None
    try:
        return max(0.0, float(raw))
    except (TypeError, ValueError):
        return None


def classify(exc: BaseException) -> Classified:
    """Name a failure of `litellm.completion` and say whether retrying later may help."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    message = str(exc).strip() or type(exc).__name__
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
