"""Steps run in the calling process (the embedded local default, or `--inline`), and so do the
runAsync and runIsolated calls they dispatch, so a session advances with no worker running."""

from __future__ import annotations

import time

from celery_agents.drivers.base import EventHook, LocalRunners, Publisher, lane_of, replay
from celery_agents.errors import SessionNotAdvanceable
from celery_agents.model import CallState, State, Status, TrackedCall
from celery_agents.model.admission import DEFAULT_PRIORITY
from celery_agents.store import Finished, Store

#: step outcomes after which an auto-driven session may take its next step here
_GO_ON = ("committed", "stale")
#: how often a step run here that waits for a slot of a fleet concurrency limit looks again (s)
THROTTLED_POLL_S = 0.5


class InlineDriver:
    """Runs steps here under `owner`; wakes go to workers only when some are alive."""

    def __init__(self, store: Store, runners: LocalRunners, publisher: Publisher, owner: str) -> None:
        self.store, self.runners, self.publisher, self.owner = store, runners, publisher, owner
        #: sessions a drive here is advancing now (a child that ends here wakes its parent)
        self._driving: set[str] = set()

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
        self._run_orphaned_calls(session_id)
        self._step(session_id, version, on_event)
        replay(self.store, session_id, after, on_event)

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
        self._driving.add(session_id)
        try:
            self._drive(session_id, after, on_event)
        finally:
            self._driving.discard(session_id)

    def _drive(self, session_id: str, after: str, on_event: EventHook | None) -> None:
        store = self.store
        self._run_orphaned_calls(session_id)
        while True:
            h = store.header(session_id)
            if h.status != Status.ACTIVE or h.drive != "auto" or not h.state.owes_step:
                break
            outcome = self._step(session_id, h.version, on_event)
            after = replay(store, session_id, after, on_event)
            if outcome not in _GO_ON:
                break
        replay(store, session_id, after, on_event)

    def wake(self, session_id: str, version: int, priority: int = DEFAULT_PRIORITY) -> None:
        # With no worker alive nothing would take the message: the next command drives it here.
        if self.store.live_workers():
            self.publisher.step(session_id, version, "wake", priority)

    def dispatched(self, session_id: str, call: TrackedCall) -> None:
        """An approved delegation: its child runs here if the parent is driven (else `resume` does)."""
        if self.store.live_workers():
            self.publisher.dispatcher.call(session_id, call)
        elif self.store.header(session_id).drive == "auto":
            self._run_dispatched(session_id, call.field, call.runs_as)
            self._drive_if_idle(session_id)

    def _drive_if_idle(self, session_id: str) -> None:
        if session_id not in self._driving:
            self.drive(session_id, 0, after="0-0", publish=False, wait=True, timeout=None, on_event=None)

    def calls_ran(self, session_id: str, finished: list[Finished]) -> None:
        if self.store.header(session_id).drive == "auto":
            self.drive(session_id, 0, after="0-0", publish=False, wait=True, timeout=None, on_event=None)

    def catch_up(self) -> None:
        store = self.store
        if store.completions_waiting() and not store.live_workers():
            from celery_agents.runtime.completions import CompletionConsumer

            # Decisions that make a call run (an approved gate or delegation) run it here too.
            CompletionConsumer(store, self.owner, wake=self.wake, dispatch=self.dispatched).poll(block_ms=None)

    def interrupted(self, session_id: str) -> bool:
        """Nothing else would drive the session: its step is let go and the session paused."""
        store = self.store
        if store.header(session_id).drive != "manual":  # not paused by the step itself (run_step)
            store.set_drive(session_id, "manual")
        if store.lease_holder(session_id) == self.owner:
            store.end_step(session_id, self.owner, "", "interrupted", keep_owed=True)
        return True

    def _step(self, session_id: str, version: int, on_event: EventHook | None = None) -> str:
        """One step here; `on_event` hears its answer as it streams (its deltas are gone from the
        stream once the step commits, before the events are handed on)."""
        from celery_agents.runtime import run_step

        runners = self.runners
        while True:
            result = run_step(
                self.store,
                session_id,
                version,
                llm=runners.llm,
                tools=runners.tools,
                owner=self.owner,
                pause_on_interrupt=True,
                on_delta=on_event,
            )
            for woken in result.woken:
                self.wake(woken.session_id, woken.version, woken.priority)
            if result.throttled is None:
                break
            # A fleet limit made the model call wait: this process is the session's worker, so it
            # waits here (a slot of a concurrency limit is looked for again every half second).
            wait = result.throttled.countdown
            time.sleep(wait if result.throttled.requeue else min(wait, THROTTLED_POLL_S))
        if result.outcome == "busy":
            raise SessionNotAdvanceable(
                f"session {session_id} is running a step elsewhere; try again when it ends", session_id=session_id
            )
        for call in result.dispatch:
            self._run_dispatched(session_id, call.field, call.runs_as)
        if result.parent is not None and result.state in (State.COMPLETED, State.FAILED):
            from celery_agents.runtime.subagents import settle_parent

            finished = settle_parent(self.store, self.store.header(session_id))
            if finished is not None and finished.woken:
                self._drive_if_idle(result.parent)
        return result.outcome

    def _run_dispatched(self, session_id: str, field: str, disposition: str) -> None:
        from celery_agents.runtime import run_call

        lane = lane_of(disposition)
        res = run_call(self.store, session_id, field, self.runners.for_lane(lane), self.owner, lane)
        # A sub-agent call: its child session, new or still going, is driven here as well.
        if res.child is not None:
            self._drive_if_idle(res.child[0])
        elif res.status == "running" and res.call is not None:
            self._drive_if_idle(str(res.call.meta.child))

    def _run_orphaned_calls(self, session_id: str) -> None:
        """Dispatched calls nobody runs (this process died before running them, or a gate was
        approved while the session was not driven, and no worker is there to take them) run here
        before the session moves on."""
        store = self.store
        orphans = [
            c
            for c in store.pending_calls(session_id)
            if c.state == CallState.RUNNING
            and (c.runs_as in ("runAsync", "runIsolated") or c.then is not None or c.meta.child)
            and not store.call_leased(session_id, c.field)
        ]
        if orphans and not store.live_workers():
            for c in orphans:
                self._run_dispatched(session_id, c.field, c.runs_as)
