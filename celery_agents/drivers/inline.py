"""Steps run in the calling process (the embedded local default, or `--inline`), and so do the
runAsync and runIsolated calls they dispatch, so a session advances with no worker running."""

from __future__ import annotations

from celery_agents.drivers.base import EventHook, LocalRunners, Publisher, replay
from celery_agents.errors import SessionNotAdvanceable
from celery_agents.model import CallState, State, Status, TrackedCall
from celery_agents.store import Finished, Store

#: step outcomes after which an auto-driven session may take its next step here
_GO_ON = ("committed", "stale")


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
    ) -> None:
        self._run_orphaned_calls(session_id)
        self._step(session_id, version)
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
            outcome = self._step(session_id, h.version)
            after = replay(store, session_id, after, on_event)
            if outcome not in _GO_ON:
                break
        replay(store, session_id, after, on_event)

    def wake(self, session_id: str, version: int) -> None:
        # With no worker alive nothing would take the message: the next command drives it here.
        if self.store.live_workers():
            self.publisher.step(session_id, version, "wake")

    def dispatched(self, session_id: str, call: TrackedCall) -> None:
        """An approved delegation: its child runs here if the parent is driven (else `resume` does)."""
        if self.store.live_workers():
            self.publisher.dispatcher.call(session_id, call)
        elif self.store.header(session_id).drive == "auto":
            self._run_dispatched(session_id, call.field, call.disposition)
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

            CompletionConsumer(store, self.owner).poll(block_ms=None)

    def interrupted(self, session_id: str) -> bool:
        """Nothing else would drive the session: its step is let go and the session paused."""
        store = self.store
        if store.header(session_id).drive != "manual":  # not paused by the step itself (run_step)
            store.set_drive(session_id, "manual")
        if store.lease_holder(session_id) == self.owner:
            store.end_step(session_id, self.owner, "", "interrupted", keep_owed=True)
        return True

    def _step(self, session_id: str, version: int) -> str:
        from celery_agents.runtime import run_step

        runners = self.runners
        result = run_step(
            self.store,
            session_id,
            version,
            llm=runners.llm,
            tools=runners.tools,
            owner=self.owner,
            pause_on_interrupt=True,
        )
        if result.outcome == "busy":
            raise SessionNotAdvanceable(
                f"session {session_id} is running a step elsewhere; try again when it ends", session_id=session_id
            )
        for call in result.dispatch:
            self._run_dispatched(session_id, call.field, call.disposition)
        if result.parent is not None and result.state in (State.COMPLETED, State.FAILED):
            from celery_agents.runtime.subagents import settle_parent

            finished = settle_parent(self.store, self.store.header(session_id))
            if finished is not None and finished.woken:
                self._drive_if_idle(result.parent)
        return result.outcome

    def _run_dispatched(self, session_id: str, field: str, disposition: str) -> None:
        from celery_agents.runtime import run_call

        res = run_call(self.store, session_id, field, self.runners.for_disposition(disposition), self.owner)
        # A sub-agent call: its child session, new or still going, is driven here as well.
        if res.child is not None:
            self._drive_if_idle(res.child[0])
        elif res.status == "running" and res.call is not None:
            self._drive_if_idle(str(res.call.meta["child"]))

    def _run_orphaned_calls(self, session_id: str) -> None:
        """Dispatched calls nobody runs (this process died before running them, and no worker is
        there to take them) run here before the session moves on."""
        store = self.store
        orphans = [
            c
            for c in store.pending_calls(session_id)
            if (c.disposition in ("runAsync", "runIsolated") or (c.meta.get("child") and c.state == CallState.RUNNING))
            and not store.call_leased(session_id, c.field)
        ]
        if orphans and not store.live_workers():
            for c in orphans:
                self._run_dispatched(session_id, c.field, c.disposition)
