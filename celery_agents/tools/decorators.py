"""The disposition's decorators around executing a call: limits, retries with backoff, truncate.

- `limits`: defaults, overridden field by field by the tool's `limits`, then the disposition's.
- `retries`: up to N more attempts, only after a failure the tool marked retryable (exit status
  75, an exception with `retryable = True`) or a timeout; waits `backoffSeconds` (0.5 by
  default), doubled each time, at most 30 s.
- `truncate`: at most N bytes of result text, with a note saying it was cut and from what size.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from celery_agents.backoff import exponential_backoff
from celery_agents.model import CallMeta, CallOutcome
from celery_agents.model.agent import Disposition, Limits, ToolSpec
from celery_agents.tools.cancel import cancelled
from celery_agents.tools.output import cut

DEFAULT_BACKOFF = 0.5
MAX_BACKOFF = 30.0


def resolve_limits(tool: ToolSpec, disp: Disposition, base: Limits) -> Limits:
    limits = base
    if tool.limits is not None:
        limits = tool.limits.over(limits)
    if disp.limits is not None:
        limits = disp.limits.over(limits)
    return limits


def backoff_delay(disp: Disposition, retry: int) -> float:
    """Seconds to wait before retry number `retry` (1, 2, ...)."""
    base = DEFAULT_BACKOFF if disp.backoff_seconds is None else disp.backoff_seconds
    return exponential_backoff(base, retry, MAX_BACKOFF)


def with_retries(
    once: Callable[[], CallOutcome], disp: Disposition, sleep: Callable[[float], None] = time.sleep
) -> CallOutcome:
    """Run `once` until it succeeds, fails for good, or the retries are spent."""
    allowed = 1 + (disp.retries or 0)
    started = time.monotonic()
    errors: list[str] = []
    outcome = CallOutcome(state="failed", error="not run", attempts=0)
    for attempt in range(1, allowed + 1):
        outcome = once()
        outcome.attempts = attempt
        if outcome.state == "completed" or not outcome.meta.retryable or attempt == allowed or cancelled():
            break
        errors.append(outcome.error or "failed")
        sleep(backoff_delay(disp, attempt))
    if errors:
        outcome.meta |= CallMeta(earlier_attempts=errors)
        outcome.duration_ms = (time.monotonic() - started) * 1000
    return outcome


def apply_truncate(outcome: CallOutcome, limit: int | None) -> CallOutcome:
    if limit is None or outcome.state != "completed":
        return outcome
    outcome.result, size = cut(outcome.result, limit)
    if size is not None:
        outcome.meta |= CallMeta(truncated={"bytes": size, "limit": limit})
    return outcome
