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
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from celery_agents.config import Settings
from celery_agents.drivers import CeleryDriver, EventHook, InlineDriver, LocalRunners, Publisher, StepDriver
from celery_agents.errors import InvalidInput, SessionNotAdvanceable, UnknownSession
from celery_agents.model import (
    FINAL_EVENTS,
    AgentSpec,
    CompletionOutcome,
    PendingCall,
    SessionHeader,
    SessionView,
    State,
    Status,
    UserQuery,
    load_agent_file,
)
from celery_agents.store import FINISHED_STATES, EmbeddedRedis, Store, client_for_url

if TYPE_CHECKING:
    from celery_agents.scheduler.ports import LlmPort, ToolPort
    from celery_agents.tasks.config import Dispatcher

__all__ = ["Client", "EventHook", "check_prompt"]


class Client:
    """A connection to celery-agents' Redis, and the verbs of the CLI. How steps run is the
    driver's business (`celery_agents.drivers`): inline here, or on Celery workers."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        inline: bool | None = None,
        llm: LlmPort | None = None,
        tools: ToolPort | None = None,
    ) -> None:
        self.settings = settings or Settings.from_env()
        self.inline = self.settings.embedded if inline is None else inline
        self.runners = LocalRunners(llm, tools)
        self.publisher = Publisher(self.settings)
        self._store: Store | None = None
        self._embedded: EmbeddedRedis | None = None
        self._driver: StepDriver | None = None
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

    @property
    def driver(self) -> StepDriver:
        """Inline (steps here) or Celery (steps on workers), chosen by `inline`."""
        if self._driver is None:
            if self.inline:
                self._driver = InlineDriver(self.store, self.runners, self.publisher, self.owner)
            else:
                self._driver = CeleryDriver(self.store, self.publisher)
        return self._driver

    @property
    def dispatcher(self) -> Dispatcher:
        return self.publisher.dispatcher

    def close(self) -> None:
        if self._store is not None:
            self._store.client.close()
            self._store = None
        self._driver = None
        if self._embedded is not None:
            self._embedded.release()
            self._embedded = None

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- ids ---------------------------------------------------------------------------------
    def resolve(self, session_id: str) -> str:
        """The whole session id for an id or any unique prefix of one (as git takes commits); an
        ambiguous prefix is refused. A whole id costs no round trip."""
        if _WHOLE_ID.match(session_id):
            return session_id
        return self.store.resolve(session_id)

    # -- views -------------------------------------------------------------------------------
    def view(self, session_id: str, *, detail: bool = False) -> SessionView:
        """The contract's session view; `detail` adds the turns and every tracked call."""
        session_id = self.resolve(session_id)
        view = self._views([self.store.header(session_id)])[0]
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
        """Unfinished calls of every session, or of one session and its child sessions (theirs
        name the child's session id)."""
        session_id = None if session_id is None else self.resolve(session_id)
        self.catch_up()
        if session_id is None:
            return self.store.pending_view(None, limit=limit)
        out = self.store.pending_view(session_id, limit=limit)
        for child in self.store.tree(session_id)[1:]:
            with contextlib.suppress(UnknownSession):  # not made yet, or deleted before its parent
                out += self.store.pending_view(child, limit=limit)
        return out[:limit]

    def events(self, session_id: str, *, follow: bool = False, after: str = "0-0") -> Iterator[dict[str, Any]]:
        store = self.store
        session_id = self.resolve(session_id)
        store.header(session_id)
        if follow:
            for e in store.follow_events(session_id, after):
                yield e
                if e["type"] in FINAL_EVENTS:
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
            self.driver.drive(
                h.session_id, h.version, after="0-0", publish=True, wait=wait, timeout=timeout, on_event=on_event
            )
            return self.view(h.session_id)
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
        after = store.last_event_id(session_id)
        self.driver.step(session_id, version, after=after, wait=wait, timeout=timeout, on_event=on_event)
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
        self.driver.drive(session_id, version, after=after, publish=owed, wait=wait, timeout=timeout, on_event=on_event)
        return self.view(session_id)

    def pause(self, session_id: str) -> SessionView:
        """Stop driving: no further step is enqueued; a step in flight finishes and commits."""
        session_id = self.resolve(session_id)
        self.store.set_drive(session_id, "manual")
        return self.view(session_id)

    def cancel(self, session_id: str) -> SessionView:
        """Stop the session for good: unfinished calls cancelled, tokens dead; its child sessions
        (and theirs) are cancelled too, and the parent of a cancelled child learns that its call
        failed."""
        from celery_agents.runtime.subagents import settle_parent

        session_id = self.resolve(session_id)
        store = self.store
        try:
            store.cancel(session_id)
        except SessionNotAdvanceable:
            # An ended parent can still have a child that goes on (one sent a follow-up): the
            # cancel reaches the tree all the same, and the parent's own refusal stands.
            self._cancel_children(session_id)
            raise
        self._cancel_children(session_id)
        header = store.header(session_id)
        finished = settle_parent(store, header)
        if finished is not None and finished.woken and header.parent:
            self.driver.wake(header.parent, finished.version)
        return self.view(session_id)

    def _cancel_children(self, session_id: str) -> None:
        for child in self.store.tree(session_id)[1:]:
            with contextlib.suppress(SessionNotAdvanceable, UnknownSession):  # ended, or not made yet
                self.store.cancel(child)

    def complete(self, token: str, result: Any, *, error: bool = False, by: str | None = None) -> CompletionOutcome:
        """Complete a deferred call with its result (or, with `error`, its error text)."""
        from celery_agents.runtime.completions import complete

        driver = self.driver
        return complete(self.store, token, result, is_error=error, by=by, wake=driver.wake, dispatch=driver.dispatched)

    def catch_up(self) -> None:
        """Apply what only workers apply otherwise: due deadlines and, when no worker runs, the
        completions other systems wrote to the stream."""
        driver = self.driver
        for sid, finished in self.store.expire_due():
            if finished.woken:
                driver.wake(sid, finished.version)
        driver.catch_up()

    def interrupted(self, session_id: str) -> bool:
        """The command driving `session_id` was interrupted (Ctrl-C). Inline, nothing else would
        drive it: its step is let go and the session paused (True); on workers it goes on (False)."""
        return self.driver.interrupted(self.resolve(session_id))

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

    def run_isolated(self, session_id: str) -> SessionView:
        """Run this session's unfinished runIsolated calls here, sandboxed, and record their results."""
        from celery_agents.runtime import run_call

        session_id = self.resolve(session_id)
        store = self.store
        finished = []
        for call in store.pending_calls(session_id):
            if call.disposition != "runIsolated":
                continue
            res = run_call(store, session_id, call.field, self.runners.isolated, self.owner)
            if res.finished is not None:
                finished.append(res.finished)
        self.driver.calls_ran(session_id, finished)
        return self.view(session_id)


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
