"""The Python API: everything the CLI does, for programs.

    from celery_agents import Client
    with Client() as client:
        view = client.start("examples/demo-agent.json", "What is the weather in Paris?", run=True)

With `AGENTS_REDIS_URL` set, commands that advance a session publish to the workers and wait for
the outcome (`wait=False` returns at once, `timeout` bounds the wait). Without it (the embedded
local default), or with `inline=True`, steps run in this process, and so do the runAsync and
runIsolated calls they dispatch.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import re
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from celery_agents.config import Settings
from celery_agents.errors import InvalidInput, SessionNotAdvanceable, UnknownSession, WaitTimeout
from celery_agents.model import (
    AgentSpec,
    CallState,
    CompletionOutcome,
    PendingCall,
    SessionHeader,
    SessionView,
    State,
    Status,
    TrackedCall,
    UserQuery,
    load_agent_file,
)
from celery_agents.store import FINISHED_STATES, EmbeddedRedis, Store, client_for_url

if TYPE_CHECKING:
    from celery_agents.tools import ToolRunner

EventHook = Callable[[dict[str, Any]], None]


class Client:
    """A connection to celery-agents' Redis, and the verbs of the CLI."""

    def __init__(
        self, settings: Settings | None = None, *, inline: bool | None = None, llm: Any = None, tools: Any = None
    ) -> None:
        self.settings = settings or Settings.from_env()
        self.inline = self.settings.embedded if inline is None else inline
        self._llm, self._tools = llm, tools
        self._isolated: ToolRunner | None = None
        self._store: Store | None = None
        self._embedded: EmbeddedRedis | None = None
        self._dispatcher: Any = None
        #: sessions an inline drive of this client is driving now (a child that ends wakes its parent)
        self._driving: set[str] = set()
        self.owner = f"cli@{socket.gethostname()}:{os.getpid()}"

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def store(self) -> Store:
        if self._store is None:
            if self.settings.embedded:
                self._embedded = EmbeddedRedis(self.settings.home).acquire()
                url = self._embedded.url
            else:
                url = self.settings.redis_url or ""
            self._store = Store(client_for_url(url), self.settings)
        return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.client.close()
            self._store = None
        if self._embedded is not None:
            self._embedded.release()
            self._embedded = None

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def dispatcher(self) -> Any:
        if self._dispatcher is None:
            from celery_agents.tasks.config import Dispatcher, make_app

            self._dispatcher = Dispatcher(make_app(self.settings, main="celery_agents_client"))
        return self._dispatcher

    def _ports(self) -> tuple[Any, Any, Any]:
        if self._llm is None:
            from celery_agents.llm import LitellmPort

            self._llm = LitellmPort()
        if self._tools is None or self._isolated is None:
            from celery_agents.tools import ToolRunner

            self._tools = self._tools or ToolRunner()
            self._isolated = ToolRunner(isolated=True)
        return self._llm, self._tools, self._isolated

    # -- ids ---------------------------------------------------------------------------------
    def resolve(self, session_id: str) -> str:
        """The whole session id for an id or any unique prefix of one (as git takes commits); an
        ambiguous prefix is refused. A whole id costs no round trip."""
        if _WHOLE_ID.match(session_id):
            return session_id
        return self.store.resolve(session_id)

    # -- views -------------------------------------------------------------------------------
    def view(self, session_id: str, *, detail: bool = False, header: SessionHeader | None = None) -> SessionView:
        """The contract's session view; `detail` adds the turns and every tracked call."""
        session_id = header.session_id if header else self.resolve(session_id)
        h = header or self.store.header(session_id)
        view = self._views([h])[0]
        if detail:
            view.turns = [t.model_dump(mode="json") for t in self.store.turns(session_id)]
            view.calls = [c.model_dump(mode="json") for c in self.store.calls(session_id)]
        return view

    def _views(self, headers: list[SessionHeader]) -> list[SessionView]:
        views = []
        for h, (pending, leased, children) in zip(headers, self.store.live_state(headers), strict=True):
            running = h.status == Status.ACTIVE and leased
            views.append(
                SessionView(
                    session_id=h.session_id,
                    state=State.RUNNING if running else h.state,
                    head=h.head,
                    version=h.version,
                    steps=h.steps,
                    pending=pending,
                    response=h.response,
                    error=h.error,
                    status=h.status,
                    drive=h.drive,
                    agent=h.agent_slug,
                    usage=h.usage,
                    created_at=h.created_at,
                    updated_at=h.updated_at,
                    parent=h.parent,
                    children=children,
                )
            )
        return views

    def show(self, session_id: str, *, detail: bool = True) -> SessionView:
        session_id = self.resolve(session_id)
        self.catch_up()
        return self.view(session_id, detail=detail)

    def list(self, status: str | None = None, limit: int = 50) -> list[SessionView]:
        if status is not None and status not in {s.value for s in State}:
            raise InvalidInput(
                f"unknown status {status!r}: use ready, tools, running, waiting, completed, failed or cancelled"
            )
        if status != State.RUNNING.value:
            return self._views(self.store.list_sessions(status, limit))
        # `running` is not stored: it is an active session whose step holds its lease now.
        views = self._views(self.store.list_sessions(None, max(limit, 500)))
        return [v for v in views if v.state == State.RUNNING][:limit]

    # `list` below is the method above: `builtins.list` is the type.
    def pending(self, session_id: str | None = None, limit: int = 1000) -> builtins.list[PendingCall]:
        """Unfinished calls of every session, or of one session and its child sessions."""
        session_id = None if session_id is None else self.resolve(session_id)
        self.catch_up()
        if session_id is None:
            return self.store.pending_view(None, limit=limit)
        return [p for sid in self.tree(session_id) for p in self.store.pending_view(sid, limit=limit)][:limit]

    def events(self, session_id: str, *, follow: bool = False, after: str = "0-0") -> Iterator[dict[str, Any]]:
        store = self.store
        session_id = self.resolve(session_id)
        store.header(session_id)
        if follow:
            for e in store.follow_events(session_id, after):
                yield e
                if e["type"] in _FINAL_EVENTS:
                    return  # the session ended: nothing more will come
            return
        while True:
            batch = store.read_events(session_id, after)
            if not batch:
                return
            yield from batch
            after = batch[-1]["id"]

    # -- starting ----------------------------------------------------------------------------
    def start(
        self,
        agent: AgentSpec | str | Path,
        prompt: str | UserQuery,
        *,
        step: bool = False,
        run: bool = False,
        wait: bool = True,
        timeout: float | None = None,
        on_event: EventHook | None = None,
        on_created: Callable[[str], None] | None = None,
    ) -> SessionView:
        """Create a session from a prompt; `step` runs one step, `run` drives it until it completes or
        only external work remains. `on_created` hears the new id before any step runs."""
        if step and run:
            raise InvalidInput("choose --step or --run, not both")
        spec = agent if isinstance(agent, AgentSpec) else load_agent_file(agent)
        query = prompt if isinstance(prompt, UserQuery) else UserQuery(text=prompt)
        check_prompt(query, self.settings.max_prompt_bytes)
        h = self.store.create_session(spec, query, drive="auto" if run else "manual", owe=run)
        if on_created is not None:
            on_created(h.session_id)
        if run:
            return self._drive(h.session_id, h.version, wait=wait, timeout=timeout, on_event=on_event, after="0-0")
        if step:
            return self.step(h.session_id, wait=wait, timeout=timeout, on_event=on_event)
        return self.view(h.session_id)

    # -- advancing ---------------------------------------------------------------------------
    def step(
        self, session_id: str, *, wait: bool = True, timeout: float | None = None, on_event: EventHook | None = None
    ) -> SessionView:
        """Run exactly one step (a failed session is retried from its last committed state)."""
        session_id = self.resolve(session_id)
        store = self.store
        self.catch_up()
        version = store.prepare_step(session_id)
        if self.inline:
            after = store.last_event_id(session_id)
            self._run_orphaned_calls(session_id)
            self._step_inline(session_id, version)
            self._replay(session_id, after, on_event)
            return self.view(session_id)
        request = uuid.uuid4().hex
        after = store.last_event_id(session_id)
        self.dispatcher.step(session_id, version, request)
        if wait:
            self._wait(session_id, after, timeout, on_event, lambda e: _step_done(e, version, request))
        return self.view(session_id)

    def send(
        self,
        session_id: str,
        prompt: str | UserQuery,
        step: bool = False,
        run: bool = False,
        *,
        wait: bool = True,
        timeout: float | None = None,
        on_event: EventHook | None = None,
    ) -> SessionView:
        """Send a user message: it continues a completed conversation (the session becomes ready),
        or waits for a waiting or running session's next model call, after the pending tool
        results. `step` then runs one step, `run` drives the session. A cancelled one refuses."""
        if step and run:
            raise InvalidInput("choose --step or --run, not both")
        session_id = self.resolve(session_id)
        query = prompt if isinstance(prompt, UserQuery) else UserQuery(text=prompt)
        check_prompt(query, self.settings.max_prompt_bytes)
        self.store.send_message(session_id, query)
        if run:
            return self.resume(session_id, wait=wait, timeout=timeout, on_event=on_event)
        if step:
            return self.step(session_id, wait=wait, timeout=timeout, on_event=on_event)
        return self.view(session_id)

    def resume(
        self, session_id: str, *, wait: bool = True, timeout: float | None = None, on_event: EventHook | None = None
    ) -> SessionView:
        """Drive the session (auto) until it completes, fails, or only external work remains."""
        session_id = self.resolve(session_id)
        store = self.store
        self.catch_up()
        after = store.last_event_id(session_id)
        version, owed = store.set_drive(session_id, "auto")
        return self._drive(
            session_id, version, wait=wait, timeout=timeout, on_event=on_event, after=after, publish=owed
        )

    def pause(self, session_id: str) -> SessionView:
        """Stop driving: no further step is enqueued; a step in flight finishes and commits."""
        session_id = self.resolve(session_id)
        self.store.set_drive(session_id, "manual")
        return self.view(session_id)

    def cancel(self, session_id: str) -> SessionView:
        """Stop the session for good: unfinished calls cancelled, tokens dead; its child sessions
        (and theirs) are cancelled too, and a child's parent learns that its call failed."""
        from celery_agents.runtime.subagents import settle_parent

        session_id = self.resolve(session_id)
        store = self.store
        store.cancel(session_id)
        self._cancel_children(session_id)
        finished = settle_parent(store, store.header(session_id))
        if finished is not None and finished.woken:
            self._woken(store.header(session_id).parent or "", finished.version)
        return self.view(session_id)

    def _cancel_children(self, session_id: str) -> None:
        for child in self.store.children(session_id):
            with contextlib.suppress(SessionNotAdvanceable, UnknownSession):  # ended, or not made yet
                self.store.cancel(child)
            self._cancel_children(child)

    def tree(self, session_id: str) -> builtins.list[str]:
        """The session and its descendants, parents before children."""
        out, todo = [], [session_id]
        while todo:
            sid = todo.pop(0)
            out.append(sid)
            todo += self.store.children(sid)
        return out

    def complete(self, token: str, result: Any, *, error: bool = False, by: str | None = None) -> CompletionOutcome:
        """Complete a deferred call with its result (or, with `error`, its error text)."""
        from celery_agents.runtime.completions import complete

        publish = self._publish_wakes()
        return complete(
            self.store,
            token,
            result,
            is_error=error,
            by=by,
            wake=self._wake if publish else None,
            dispatch=self.dispatcher.call if publish else self._run_approved,
        )

    def _run_approved(self, session_id: str, call: TrackedCall) -> None:
        """Inline, an approved delegation starts (and drives) its child session here, unless no
        command drives the parent now (then `resume` does it: the call waits as dispatched)."""
        if self.store.header(session_id).drive == "auto":
            self._run_dispatched(session_id, call.field, call.disposition)

    def catch_up(self) -> None:
        """Apply what only workers apply otherwise: due deadlines and, when no worker runs, the
        completions other systems wrote to the stream."""
        store = self.store
        for sid, finished in store.expire_due():
            if finished.woken and self._publish_wakes():
                self._wake(sid, finished.version)
        if self.inline and store.client.xlen(store.keys.completions) and not store.live_workers():
            from celery_agents.runtime.completions import CompletionConsumer

            CompletionConsumer(store, self.owner).poll(block_ms=None)

    def interrupted(self, session_id: str) -> bool:
        """The command driving `session_id` was interrupted (Ctrl-C). Inline, nothing else would
        drive it: its step is let go and the session paused (True); on workers it goes on (False)."""
        if not self.inline:
            return False
        store = self.store
        if store.lease_holder(session_id) == self.owner:
            store.end_step(session_id, self.owner, "", "interrupted", keep_owed=True)
        self.pause(session_id)
        return True

    # -- removing ----------------------------------------------------------------------------
    def delete(self, session_id: str, *, force: bool = False) -> str:
        """Delete a finished session and everything of it in Redis; returns its whole id. `force`
        cancels an active one first."""
        session_id = self.resolve(session_id)
        if force:
            with contextlib.suppress(SessionNotAdvanceable):  # already ended
                self.store.cancel(session_id)
        self.store.delete_session(session_id, force=force)
        return session_id

    def purge(self, states: builtins.list[str], older_than: float, limit: int | None = None) -> builtins.list[str]:
        """Delete sessions in `states` (completed, failed, cancelled) not updated for `older_than`
        seconds (by Redis's clock); returns the ids deleted."""
        bad = [s for s in states if s not in _FINISHED]
        if bad or not states:
            raise InvalidInput(
                f"purge takes finished states only ({', '.join(_FINISHED)}); got {', '.join(bad) or 'none'}"
            )
        store = self.store
        return store.purge(states, store.server_time() - older_than, limit)

    def _woken(self, session_id: str, version: int) -> None:
        """A session was woken (owed a step): publish it, or drive it here when inline."""
        if self._publish_wakes():
            self._wake(session_id, version)
        elif session_id not in self._driving:
            self._drive_inline(session_id)

    def _wake(self, session_id: str, version: int) -> None:
        self.dispatcher.step(session_id, version, "wake")

    def run_isolated(self, session_id: str) -> SessionView:
        """Run this session's unfinished runIsolated calls here, sandboxed, and record their results."""
        from celery_agents.runtime import run_call

        session_id = self.resolve(session_id)
        store = self.store
        _, _, isolated = self._ports()
        for call in store.pending_calls(session_id):
            if call.disposition != "runIsolated":
                continue
            res = run_call(store, session_id, call.field, isolated, self.owner)
            if res.finished is not None and res.finished.woken and not self.inline:
                self.dispatcher.step(session_id, res.finished.version, "wake")
        if self.inline:
            h = store.header(session_id)
            if h.drive == "auto":
                self._drive_inline(session_id)
        return self.view(session_id)

    # -- inline execution --------------------------------------------------------------------
    def _publish_wakes(self) -> bool:
        return not self.inline or bool(self.store.live_workers())

    def _step_inline(self, session_id: str, version: int) -> str:
        from celery_agents.runtime import run_step

        llm, tools, _ = self._ports()
        result = run_step(self.store, session_id, version, llm=llm, tools=tools, owner=self.owner)
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
                self._woken(result.parent, finished.version)
        return result.outcome

    def _run_dispatched(self, session_id: str, field: str, disposition: str) -> None:
        from celery_agents.runtime import run_call

        _, tools, isolated = self._ports()
        res = run_call(self.store, session_id, field, isolated if disposition == "runIsolated" else tools, self.owner)
        if res.child is not None:  # a sub-agent call: its child session is driven here as well
            self._drive_inline(res.child[0])

    def _run_orphaned_calls(self, session_id: str) -> None:
        """Dispatched calls nobody runs (this process died before running them, and no worker is
        there to take them) run here before the session moves on."""
        store = self.store
        orphans = [
            c
            for c in store.pending_calls(session_id)
            if (c.disposition in ("runAsync", "runIsolated") or (c.meta.get("child") and c.state == CallState.RUNNING))
            and not store.client.exists(store.keys.call_lease(session_id, c.field))
        ]
        if orphans and not store.live_workers():
            for c in orphans:
                self._run_dispatched(session_id, c.field, c.disposition)

    def _drive_inline(self, session_id: str, on_event: EventHook | None = None, after: str = "0-0") -> None:
        self._driving.add(session_id)
        try:
            self._drive_inline_loop(session_id, on_event, after)
        finally:
            self._driving.discard(session_id)

    def _drive_inline_loop(self, session_id: str, on_event: EventHook | None, after: str) -> None:
        store = self.store
        self._run_orphaned_calls(session_id)
        while True:
            h = store.header(session_id)
            if h.status != Status.ACTIVE or h.drive != "auto" or h.state not in (State.READY, State.TOOLS):
                break
            outcome = self._step_inline(session_id, h.version)
            after = self._replay(session_id, after, on_event)
            if outcome not in ("committed", "stale"):
                break
        self._replay(session_id, after, on_event)

    def _replay(self, session_id: str, after: str, on_event: EventHook | None) -> str:
        if on_event is None:
            return after
        for e in self.store.read_events(session_id, after):
            on_event(e)
            after = e["id"]
        return after

    # -- queue mode --------------------------------------------------------------------------
    def _drive(
        self,
        session_id: str,
        version: int,
        *,
        wait: bool,
        timeout: float | None,
        on_event: EventHook | None,
        after: str,
        publish: bool = True,
    ) -> SessionView:
        if self.inline:
            self._drive_inline(session_id, on_event, after)
            return self.view(session_id)
        if publish:
            self.dispatcher.step(session_id, version, "drive")
        if wait:
            self._wait(session_id, after, timeout, on_event, lambda e: self._settled(session_id, e))
        return self.view(session_id)

    def _settled(self, session_id: str, event: dict[str, Any] | None) -> bool:
        if event is not None and event["type"] not in (
            "step_committed",
            "step_noop",
            "step_skipped",
            "failed",
            "cancelled",
            "paused",
            "tool_finished",
            "token_completed",
            "token_expired",
        ):
            return False
        store = self.store
        h = store.header(session_id)
        if h.status != Status.ACTIVE:
            return True
        if store.lease_holder(session_id):
            return False
        if h.state in (State.READY, State.TOOLS):
            return h.drive != "auto"
        pending = store.pending_calls(session_id)
        if not pending:
            # Its last call finished after the header was read: the session has moved on (in auto
            # drive a step follows), so look again at the next event or tick.
            return False
        if any(c.meta.get("child") for c in pending):
            # Waiting on child sessions: settled when only people's work is left in the tree (a
            # call waiting on a child stands for what the child waits on).
            pending = [c for sid in self.tree(session_id) for c in store.pending_calls(sid)]
            pending = [c for c in pending if c.state == CallState.DEFERRED or not c.meta.get("child")]
        return bool(pending) and all(c.state == CallState.DEFERRED for c in pending)

    def _wait(
        self,
        session_id: str,
        after: str,
        timeout: float | None,
        on_event: EventHook | None,
        done: Callable[[dict[str, Any] | None], bool],
    ) -> None:
        store = self.store
        deadline = None if timeout is None else time.monotonic() + timeout
        if done(None):
            self._replay(session_id, after, on_event)
            return
        while True:
            block = 1000
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeout(
                        f"no outcome for session {session_id} within {timeout:g} s; the work goes on "
                        f"(see `agents session show {session_id}`)",
                        session_id=session_id,
                    )
                block = max(1, min(block, int(left * 1000)))
            events = store.read_events(session_id, after, block_ms=block)
            for e in events:
                after = e["id"]
                if on_event is not None:
                    on_event(e)
                if done(e):
                    return
            if not events and done(None):
                return


def check_prompt(query: UserQuery, max_bytes: int) -> None:
    """The one rule on a prompt (start, and any later message): not empty, text within the limit
    (attachments have their own, AGENTS_MEDIA_MAX_BYTES)."""
    if not query.text.strip() and not query.media:
        raise InvalidInput("the prompt is empty: give -p TEXT, --file PATH or --media PATH")
    size = len(query.text.encode(errors="surrogatepass"))
    if size > max_bytes:
        raise InvalidInput(f"the prompt is {size} bytes, more than the limit of {max_bytes} (AGENTS_MAX_PROMPT_BYTES)")


_WHOLE_ID = re.compile(r"^[0-9a-f]{32}$")
_FINISHED = FINISHED_STATES
_FINAL_EVENTS = frozenset({"completed", "failed", "cancelled"})


def _step_done(event: dict[str, Any] | None, version: int, request: str) -> bool:
    if event is None:
        return False
    kind = event["type"]
    if kind == "step_committed" and event.get("from_version") == version:
        return True
    if event.get("request") == request and kind in ("step_noop", "step_committed"):
        return True
    if event.get("request") == request and kind == "step_skipped" and event.get("reason") != "busy":
        return True
    return kind in ("failed", "cancelled")
