"""Steps run on Celery workers: a step or a drive is published to the `steps` queue and the caller
waits on the session's event stream until the outcome shows (`wait=False` returns at once,
`timeout` bounds the wait)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from celery_agents.drivers.base import EventHook, Publisher, replay
from celery_agents.errors import WaitTimeout
from celery_agents.model import CallState, EventType, Status, TrackedCall
from celery_agents.model.admission import DEFAULT_PRIORITY
from celery_agents.store import Finished, Store
from celery_agents.store.views import WATCH_RENEW_S

Done = Callable[[dict[str, Any] | None], bool]

#: events after which a driven session may have settled (looked at again when one arrives)
_SETTLING_EVENTS = frozenset(
    {
        EventType.STEP_COMMITTED,
        EventType.STEP_NOOP,
        EventType.STEP_SKIPPED,
        EventType.FAILED,
        EventType.CANCELLED,
        EventType.PAUSED,
        EventType.TOOL_FINISHED,
        EventType.TOKEN_COMPLETED,
        EventType.TOKEN_EXPIRED,
    }
)


class CeleryDriver:
    """Publishes steps and waits for their outcome on the event stream."""

    def __init__(self, store: Store, publisher: Publisher) -> None:
        self.store, self.publisher = store, publisher

    def step(
        self,
        session_id: str,
        version: int,
        *,
        after: str,
        wait: bool,
        timeout: float | None,
        on_event: EventHook | None,
        priority: int = DEFAULT_PRIORITY,
    ) -> None:
        request = uuid.uuid4().hex
        if wait and on_event is not None:
            self.store.watch(session_id)  # before the step can begin: its model call streams
        self.publisher.step(session_id, version, request, priority)
        if wait:
            self._wait(session_id, after, timeout, on_event, lambda e: step_done(e, version, request))

    def drive(
        self,
        session_id: str,
        version: int,
        *,
        after: str,
        publish: bool,
        wait: bool,
        timeout: float | None,
        on_event: EventHook | None,
        priority: int = DEFAULT_PRIORITY,
    ) -> None:
        if wait and on_event is not None:
            self.store.watch(session_id)
        if publish:
            self.publisher.step(session_id, version, "drive", priority)
        if wait:
            self._wait(session_id, after, timeout, on_event, lambda e: settled(self.store, session_id, e), drain=True)

    def wake(self, session_id: str, version: int, priority: int = DEFAULT_PRIORITY) -> None:
        self.publisher.step(session_id, version, "wake", priority)

    def calls_ran(self, session_id: str, finished: list[Finished]) -> None:
        for f in finished:
            if f.woken:
                self.wake(session_id, f.version, f.priority)

    def dispatched(self, session_id: str, call: TrackedCall) -> None:
        self.publisher.dispatcher.call(session_id, call)

    def catch_up(self) -> None:
        """Workers apply the completions stream."""

    def interrupted(self, session_id: str) -> bool:
        """The workers go on with the session."""
        return False

    def _wait(
        self,
        session_id: str,
        after: str,
        timeout: float | None,
        on_event: EventHook | None,
        done: Done,
        *,
        drain: bool = False,
    ) -> None:
        """Hand events to `on_event` until `done`. `drain`: `done` looked at the header, which can
        be ahead of the events read so far (the session completed while a tool's event was being
        handled): the events that led there are handed too, so none of them goes unseen."""
        store = self.store
        deadline = None if timeout is None else time.monotonic() + timeout
        watched = time.monotonic()
        if done(None):
            replay(store, session_id, after, on_event)
            return
        while True:
            if on_event is not None and time.monotonic() - watched > WATCH_RENEW_S:
                store.watch(session_id)  # someone hears the events: the session's model calls stream
                watched = time.monotonic()
            events = store.read_events(session_id, after, block_ms=_block_ms(session_id, deadline, timeout))
            for e in events:
                after = e["id"]
                if on_event is not None:
                    on_event(e)
                if done(e):
                    if drain:
                        replay(store, session_id, after, on_event)
                    return
            if not events and done(None):
                if drain:
                    replay(store, session_id, after, on_event)
                return


def _block_ms(session_id: str, deadline: float | None, timeout: float | None) -> int:
    """How long the next read of the stream may block: a second, or what is left of the timeout."""
    if deadline is None or timeout is None:
        return 1000
    left = deadline - time.monotonic()
    if left <= 0:
        raise WaitTimeout(
            f"no outcome for session {session_id} within {timeout:g} s; the work goes on "
            f"(see `agents session show {session_id}`)",
            session_id=session_id,
        )
    return max(1, min(1000, int(left * 1000)))


def settled(store: Store, session_id: str, event: dict[str, Any] | None) -> bool:
    """A driven session has stopped for now: ended, waiting on external work only, or (manual
    drive) ready for an explicit step. `event` is the one just read (None: a quiet tick)."""
    if event is not None and event["type"] not in _SETTLING_EVENTS:
        return False
    h = store.header(session_id)
    if h.status != Status.ACTIVE:
        return True
    if store.lease_holder(session_id):
        return False
    if h.state.owes_step:
        return h.drive != "auto"
    pending = store.pending_calls(session_id)
    if not pending:
        # Its last call finished after the header was read: the session has moved on (in auto
        # drive a step follows), so look again at the next event or tick.
        return False
    if any(c.meta.child for c in pending):
        # Waiting on child sessions: settled when only people's work is left in the tree (a call
        # waiting on a child stands for what the child waits on).
        pending = store.tree_pending_calls(session_id)
        pending = [c for c in pending if c.state == CallState.DEFERRED or not c.meta.child]
    return bool(pending) and all(c.state == CallState.DEFERRED for c in pending)


def step_done(event: dict[str, Any] | None, version: int, request: str) -> bool:
    """The step published as `request` at `version` has an outcome (or the session ended)."""
    if event is None:
        return False
    kind = event["type"]
    if kind == EventType.STEP_COMMITTED and event.get("from_version") == version:
        return True
    if event.get("request") == request and kind in (EventType.STEP_NOOP, EventType.STEP_COMMITTED):
        return True
    if event.get("request") == request and kind == EventType.STEP_SKIPPED and event.get("reason") != "busy":
        return True
    return kind in (EventType.FAILED, EventType.CANCELLED)
