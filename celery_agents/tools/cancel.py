"""Stopping a running call from outside: when the call's session is cancelled, the runtime sets the
call's event; the process runner polls it and kills the call's process group, and no retry follows.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator

_current: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("celery_agents_cancel", default=None)


@contextlib.contextmanager
def cancellable(event: threading.Event) -> Iterator[threading.Event]:
    """Run the calls in this block (in this thread) so that setting `event` stops them."""
    token = _current.set(event)
    try:
        yield event
    finally:
        _current.reset(token)


def cancelled() -> bool:
    event = _current.get()
    return event is not None and event.is_set()
