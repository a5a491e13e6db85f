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
import datetime
import json
import os
import re
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from celery_agents.config import Settings
from celery_agents.drivers import CeleryDriver, EventHook, InlineDriver, LocalRunners, Publisher, StepDriver
from celery_agents.errors import (
    AgentsError,
    InvalidInput,
    SessionNotAdvanceable,
    UnknownLimit,
    UnknownSession,
    UnknownToken,
)
from celery_agents.model import (
    FINAL_EVENTS,
    AgentFile,
    AgentSpec,
    Budget,
    CallState,
    CompletionOutcome,
    ForkOrigin,
    PendingCall,
    SessionHeader,
    SessionView,
    State,
    Status,
    TrackedCall,
    UserQuery,
    VersionEntry,
    call_digest,
)
from celery_agents.model.admission import LimitUsage, Pause
from celery_agents.store import FINISHED_STATES, EmbeddedRedis, Store, client_for_url
from celery_agents.store.counters import CounterKey, read_counters
from celery_agents.store.gauges import Backlog, read_backlog
from celery_agents.store.signing import trusted_grants
from celery_agents.store.views import WATCH_RENEW_S

if TYPE_CHECKING:
    from celery_agents.scheduler.ports import LlmPort, ToolPort
    from celery_agents.tasks.config import Dispatcher

__all__ = ["WATCH_RENEW_S", "Client", "EventHook", "FleetFigures", "check_prompt", "check_token_shape"]


@dataclass(frozen=True)
class FleetFigures:
    """The fleet's figures as `/metrics` reports them (`Client.fleet_figures`)."""

    states: dict[str, int]
    backlog: Backlog
    counters: dict[CounterKey, float]
    #: the fleet's limits with their use, the models paused, and Redis's clock (seconds) then
    limits: list[LimitUsage]
    pauses: list[Pause]
    now: float


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
        self.runners = LocalRunners(llm, tools, self.settings.tool_env)
        self.publisher = Publisher(self.settings)
        self._store: Store | None = None
        self._embedded: EmbeddedRedis | None = None
        self._driver: StepDriver | None = None
        self._format_checked = False
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

    def connect(self) -> Client:
        """Open the connections now (the store; on workers, the broker) rather than on first use:
        a server does it before its first requests' threads race to."""
        self.store  # noqa: B018
        if not self.inline:
            self.dispatcher  # noqa: B018
        return self

    def _check_format(self) -> None:
        """Before this client writes a new session: the Redis holds data of this release's stored
        format (once per client)."""
        if not self._format_checked:
            self.store.check_format()
            self._format_checked = True

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
        for h, (pending, leased, children, queued) in zip(headers, self.store.live_state(headers), strict=True):
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
                    grants=sorted(trusted_grants(self.settings.spec_key, h.session_id, h.grants)),
                    spent=h.spent,
                    budget=h.budget,
                    forked_from=ForkOrigin(session_id=h.forked_from, version=h.forked_at or 0)
                    if h.forked_from
                    else None,
                    priority=h.priority,
                    throttled_until=_iso(h.throttled_until) if h.status == Status.ACTIVE else None,
                    queued=queued,
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
                if e["type"] in FINAL_EVENTS:  # the session ended: what its last write added, then no more
                    after = e["id"]
                    break
            else:
                return
        while True:
            batch = store.read_events(session_id, after)
            if not batch:
                return
            yield from batch
            after = batch[-1]["id"]

    def read_events(
        self, session_id: str, after: str = "0-0", *, block_ms: int | None = None
    ) -> builtins.list[dict[str, Any]]:
        """One read of a session's events after `after` (blocking up to `block_ms` for new ones)."""
        return self.store.read_events(session_id, after, block_ms=block_ms)

    def watch(self, session_id: str) -> None:
        """Say that someone follows the session's events now (for 30 s; renew it while following):
        its model calls stream their answers as `text_delta` events meanwhile."""
        self.store.watch(session_id)

    def ended(self, session_id: str) -> bool:
        """The session is over: completed, failed or cancelled."""
        return self.store.header(session_id).status != Status.ACTIVE

    def tokens(self, session_id: str) -> dict[str, str]:
        """The continuation tokens of a session's deferred calls, by call id (its own, not its
        children's)."""
        return {p.call_id: p.token for p in self.store.pending_view(session_id) if p.token}

    def agent_of(self, session_id: str) -> AgentSpec:
        """The agent (its verified spec) a session runs."""
        sid = self.resolve(session_id)
        return self.store.agent(self.store.header(sid).agent_hash, sid)

    def agent_slugs(self, session_ids: builtins.list[str]) -> dict[str, str]:
        """The agent slug of each of these sessions (those that exist)."""
        return {h.session_id: h.agent_slug for h in self.store.headers(sorted(set(session_ids))).values()}

    def live_workers(self) -> builtins.list[dict[str, Any]]:
        """The workers whose heartbeat is fresh: name, queues, pool and what each reported."""
        return self.store.live_workers()

    def now(self) -> float:
        """Redis's clock (deadlines and durable times are kept in it), in seconds."""
        return self.store.server_time()

    def fleet_figures(self) -> FleetFigures:
        """What `/metrics` reports for the whole fleet: sessions by state, the backlog gauges and
        the fleet's counters, read from Redis at once."""
        store = self.store
        return FleetFigures(
            states=store.state_counts(),
            backlog=read_backlog(store.client, store.keys),
            counters=read_counters(store.client, store.keys),
            limits=store.limit_usages(),
            pauses=store.pauses(),
            now=store.server_time(),
        )

    def doctor(self, *, ack_rewound: bool = False) -> dict[str, Any]:
        """`agents doctor`'s report (`celery_agents.diagnosis`); `ack_rewound` first acknowledges
        the rewound sessions recorded now."""
        from celery_agents.diagnosis import diagnose

        return diagnose(self.settings, self.store, inline=self.inline, ack_rewound=ack_rewound)

    # -- starting ----------------------------------------------------------------------------
    def agent_spec(self, agent: AgentSpec | AgentFile | str | Path) -> AgentSpec:
        """The spec a session of `agent` stores: a file is read, then resolved (its toolboxes
        described, its python tools' signatures read, its MCP servers' tools listed); a spec is
        taken as it is. Raises `InvalidAgentFile` naming the file, the field and the fix."""
        if isinstance(agent, AgentSpec):
            return agent
        from celery_agents.model import read_agent_file
        from celery_agents.tools.resolve import resolve_agent

        return resolve_agent(agent if isinstance(agent, AgentFile) else read_agent_file(agent), self.settings)

    def start(
        self,
        agent: AgentSpec | AgentFile | str | Path,
        prompt: str | UserQuery,
        *,
        step: bool = False,
        run: bool = False,
        wait: bool = True,
        timeout: float | None = None,
        on_event: EventHook | None = None,
        on_created: Callable[[str], None] | None = None,
        watch: bool = False,
        priority: int | None = None,
    ) -> SessionView:
        """Create a session from a prompt; `step` runs one step, `run` drives it until it completes or
        only external work remains. `on_created` hears the new id before any step runs. `watch`:
        its events will be followed (SSE, `logs --follow`), so its first answer streams too (a
        session is watched while someone follows it: `watch`). `priority` (0-9, over the agent
        file's `priority`, default 5): its steps are taken before those of sessions of a lower one."""
        _step_or_run(step, run)
        spec = self.agent_spec(agent)
        query = prompt if isinstance(prompt, UserQuery) else UserQuery(text=prompt)
        check_prompt(query, self.settings.max_prompt_bytes)
        self._check_format()
        h = self.store.create_session(spec, query, drive="auto" if run else "manual", owe=run, priority=priority)
        self.store.keep()  # the id is given once Redis's append-only file holds the session
        if watch:
            self.store.watch(h.session_id)
        if on_created is not None:
            on_created(h.session_id)
        if run:
            self.driver.drive(
                h.session_id,
                h.version,
                after="0-0",
                publish=True,
                wait=wait,
                timeout=timeout,
                on_event=on_event,
                priority=h.priority,
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
        header = store.header(session_id)
        version = store.prepare_step(session_id, header)
        after = store.last_event_id(session_id)
        self.driver.step(
            session_id, version, after=after, wait=wait, timeout=timeout, on_event=on_event, priority=header.priority
        )
        return self.view(session_id)

    def send(
        self,
        session_id: str,
        prompt: str | UserQuery,
        step: bool = False,
        run: bool = False,
        *,
        interrupt: bool = False,
        wait: bool = True,
        timeout: float | None = None,
        on_event: EventHook | None = None,
    ) -> SessionView:
        """Send a user message: it continues a completed conversation (the session becomes ready),
        or waits for a waiting or running session's next model call, after the pending tool
        results (the view's `sent` says which). `interrupt`: a model call of the session in
        flight is cancelled (its partial answer dropped, its usage counted) and the next one
        includes the message; tool calls running go on. `step` then runs one step, `run` drives
        the session. A cancelled one refuses."""
        _step_or_run(step, run)
        session_id = self.resolve(session_id)
        query = prompt if isinstance(prompt, UserQuery) else UserQuery(text=prompt)
        check_prompt(query, self.settings.max_prompt_bytes)
        sent = self.store.send_message(session_id, query, interrupt=interrupt)
        self.store.keep()
        if run:
            view = self.resume(session_id, wait=wait, timeout=timeout, on_event=on_event)
        elif step:
            view = self.step(session_id, wait=wait, timeout=timeout, on_event=on_event)
        else:
            view = self.view(session_id)
        view.sent = "continued" if sent.continued else "queued"
        return view

    def resume(
        self,
        session_id: str,
        *,
        wait: bool = True,
        timeout: float | None = None,
        on_event: EventHook | None = None,
        grant: Budget | None = None,
    ) -> SessionView:
        """Drive the session (auto) until it completes, fails, or only external work remains;
        `grant` raises its budget's limits first (a session stopped by one goes on). A session
        that completed already (a worker finished it after a completion woke it) is its view:
        nothing is left to drive. A cancelled one raises `SessionNotAdvanceable`."""
        session_id = self.resolve(session_id)
        store = self.store
        self.catch_up()
        after = store.last_event_id(session_id)
        header = store.header(session_id)
        try:
            version, owed = store.set_drive(session_id, "auto", grant, header)
        except SessionNotAdvanceable as exc:
            if exc.details.get("status") != "completed":
                raise
            return self.view(session_id)
        self.driver.drive(
            session_id,
            version,
            after=after,
            publish=owed,
            wait=wait,
            timeout=timeout,
            on_event=on_event,
            priority=header.priority,
        )
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
            self.driver.wake(header.parent, finished.version, finished.priority)
        return self.view(session_id)

    def _cancel_children(self, session_id: str) -> None:
        for child in self.store.tree(session_id)[1:]:
            with contextlib.suppress(SessionNotAdvanceable, UnknownSession):  # ended, or not made yet
                self.store.cancel(child)

    def complete(self, token: str, result: Any, *, error: bool = False, by: str | None = None) -> CompletionOutcome:
        """Complete a deferred call with its result (or, with `error`, its error text)."""
        from celery_agents.runtime.completions import complete

        check_token_shape(token)
        driver = self.driver
        done = complete(self.store, token, result, is_error=error, by=by, wake=driver.wake, dispatch=driver.dispatched)
        # `accepted` once Redis's append-only file holds it: the completer keeps no copy, and a
        # lost completion leaves its session waiting (store/durability.py)
        self.store.keep()
        return done

    def approve(
        self,
        token: str,
        *,
        arguments: Any = None,
        digest: str | None = None,
        for_session: bool = False,
        by: str | None = None,
    ) -> CompletionOutcome:
        """Approve an approval gate: the call runs under its `then`, once, with `arguments` when
        given (an edit, validated against the tool's schema). `digest`: refused unless the pending
        call is the one decided on; `for_session`: later calls of the tool run without asking."""
        from celery_agents.runtime.completions import decide

        check_token_shape(token)
        driver = self.driver
        done = decide(
            self.store,
            token,
            "approve",
            arguments=arguments,
            digest=digest,
            for_session=for_session,
            by=by,
            wake=driver.wake,
            dispatch=driver.dispatched,
        )
        self.store.keep()
        return done

    def reject(
        self, token: str, *, reason: str | None = None, digest: str | None = None, by: str | None = None
    ) -> CompletionOutcome:
        """Reject an approval gate: it never runs; the model is told `rejected: <reason>`.
        `digest`: refused unless the pending call is the one decided on."""
        from celery_agents.runtime.completions import decide

        check_token_shape(token)
        done = decide(self.store, token, "reject", reason=reason, digest=digest, by=by, wake=self.driver.wake)
        self.store.keep()
        return done

    def extend(self, token: str, seconds: float) -> PendingCall:
        """Move a deferred call's deadline to now + `seconds`; the call as `pending` lists it."""
        check_token_shape(token)
        if not 0 < seconds <= MAX_EXTEND_SECONDS:
            raise InvalidInput(f"--seconds is more than 0 and at most {MAX_EXTEND_SECONDS:,.0f} (a year)")
        return self.store.extend_token(token, seconds)

    def catch_up(self) -> None:
        """Apply what only workers apply otherwise: due deadlines and, when no worker runs, the
        completions other systems wrote to the stream."""
        driver = self.driver
        now = self.store.server_time()
        for sid, finished in self.store.expire_due(now):
            if finished.woken:
                driver.wake(sid, finished.version, finished.priority)
        self.store.warn_due(now)
        driver.catch_up()

    def interrupted(self, session_id: str) -> bool:
        """The command driving `session_id` was interrupted (Ctrl-C). Inline, nothing else would
        drive it: its step is let go and the session paused (True); on workers it goes on (False)."""
        return self.driver.interrupted(self.resolve(session_id))

    # -- history -----------------------------------------------------------------------------
    def history(self, session_id: str) -> builtins.list[VersionEntry]:
        """Every version of the session, oldest first: its turn count, head, state, when, and
        what the write that made it did."""
        return self.store.history(self.resolve(session_id))

    def fork(
        self, session_id: str, *, at: int | None = None, agent: AgentSpec | AgentFile | str | Path | None = None
    ) -> SessionView:
        """A new session whose transcript is the session's at version `at` (default: its latest),
        bound to `agent` (default: the same agent). The origin does not change; copied unfinished
        deferred calls get tokens of the fork's; dispatched ones run again for the fork."""
        return self._fork(session_id, at, agent, replay=False)

    def _fork(
        self, session_id: str, at: int | None, agent: AgentSpec | AgentFile | str | Path | None, *, replay: bool
    ) -> SessionView:
        spec = None if agent is None else self.agent_spec(agent)
        self._check_format()
        origin = self.store.origin_at(self.resolve(session_id), at)
        from celery_agents.scheduler.machine import rebound_call

        # Another agent's policy decides how the copied unfinished calls run.
        rebind = None if spec is None else rebound_call
        record = self.store.fork_session(origin, spec, replay=replay, rebind=rebind)
        self.store.keep()
        sid = record.header.session_id
        for call in record.dispatch:
            self.driver.dispatched(sid, call)
        return self.view(sid)

    def rerun(
        self,
        session_id: str,
        *,
        from_version: int,
        fresh: bool = False,
        wait: bool = True,
        timeout: float | None = None,
        on_event: EventHook | None = None,
    ) -> SessionView:
        """Fork at `from_version` and drive the fork: a tool call whose tool and arguments equal
        one the origin completed after that version reuses its recorded result (`fresh`: every
        call runs)."""
        view = self._fork(session_id, from_version, None, replay=not fresh)
        return self.resume(view.session_id, wait=wait, timeout=timeout, on_event=on_event)

    def rerun_plan(self, session_id: str, *, from_version: int, fresh: bool = False) -> dict[str, Any]:
        """What `rerun` would do with the tool calls recorded at `from_version` that are not yet
        run, changing nothing: `{"would_run": [...], "reused": [...]}`."""
        from celery_agents.model.policy import disposition_for

        origin = self.store.origin_at(self.resolve(session_id), from_version)
        spec = self.store.agent(origin.header.agent_hash, origin.header.session_id)
        recorded = {} if fresh else origin.recorded_after()
        if origin.entry.head == "LlmTurn":
            asked = [(c.name, _arguments(c.arguments)) for c in getattr(origin.turns[-1], "tool_calls", [])]
        else:
            asked = [(c.tool, c.arguments) for c in origin.batch if not c.state.final]
        plan: dict[str, builtins.list[dict[str, Any]]] = {"would_run": [], "reused": []}
        for tool, arguments in asked:
            row = {"tool": tool, "arguments": arguments, "disposition": disposition_for(spec, tool, arguments).tag}
            plan["reused" if call_digest(tool, arguments) in recorded else "would_run"].append(row)
        return plan

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

    def delete_all(self, session_ids: builtins.list[str], *, force: bool = False) -> builtins.list[str]:
        """`delete` each of `session_ids`, all or none as far as can be known before: every id is
        resolved and, without `force`, every session must be finished before the first goes. One
        that a step or call still runs when its turn comes refuses the rest; its error names those
        deleted before it (`details["deleted"]`). Returns the whole ids."""
        ids = [self.resolve(sid) for sid in session_ids]
        if not force:
            for sid in ids:
                header = self.store.header(sid)
                if header.status.value == "active":
                    raise SessionNotAdvanceable(
                        f"session {sid} is still active ({header.state.value}): cancel it first (agents session "
                        f"cancel {sid}) or delete with --force; nothing was deleted",
                        session_id=sid,
                        status="active",
                    )
        deleted: builtins.list[str] = []
        for sid in ids:
            try:
                deleted.append(self.delete(sid, force=force))
            except AgentsError as exc:
                if deleted:
                    exc.message += f" ({len(deleted)} deleted before it: {', '.join(deleted)})"
                    exc.details["deleted"] = deleted
                raise
        return deleted

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

    # -- fleet limits ------------------------------------------------------------------------
    def set_limit(
        self, key: str, *, rpm: int | None = None, tpm: int | None = None, concurrency: int | None = None
    ) -> LimitUsage:
        """Limit the model calls of the whole fleet under KEY (a model name as agent files write
        it, or a `limitKey`): `rpm` calls started and `tpm` tokens per minute, `concurrency` calls
        in flight. The KEY's limits become those given (a kind left out is not limited)."""
        from pydantic import ValidationError

        from celery_agents.model.admission import ModelLimit, check_limit_key

        try:
            check_limit_key(key)
            limit = ModelLimit(rpm=rpm, tpm=tpm, concurrency=concurrency)
        except (ValueError, ValidationError) as exc:
            raise InvalidInput(_limit_problem(exc)) from None
        if limit.empty:
            raise InvalidInput("give at least one of --rpm, --tpm, --concurrency (`limits delete KEY` removes them)")
        self.store.set_limit(key, limit)
        return self.store.limit_usages([key])[0]

    def limits(self) -> tuple[builtins.list[LimitUsage], builtins.list[Pause]]:
        """Every limit with what the fleet does under it now, and the models paused now."""
        return self.store.limit_usages(), self.store.pauses()

    def delete_limit(self, key: str) -> str:
        """Remove KEY's limits; the steps waiting for one of its slots go on at once."""
        from celery_agents.model.admission import check_limit_key

        try:
            check_limit_key(key)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        removed, waiting = self.store.delete_limit(key)
        if not removed:
            raise UnknownLimit(f"no limit is set under {key!r} (`agents limits list` shows them)", key=key)
        for w in waiting:
            self.driver.wake(w.session_id, w.version, w.priority)
        return key

    def isolated_waiting(self, session_id: str) -> int:
        """How many of the session's runIsolated calls wait to run (what `run_isolated` would run)."""
        return len(self._isolated_waiting(self.resolve(session_id)))

    def _isolated_waiting(self, session_id: str) -> builtins.list[TrackedCall]:
        return [
            call
            for call in self.store.pending_calls(session_id)
            if call.runs_as == "runIsolated" and call.state == CallState.RUNNING
        ]

    def run_isolated(self, session_id: str) -> SessionView:
        """Run this session's unfinished runIsolated calls here, sandboxed, and record their results."""
        from celery_agents.runtime import run_call

        session_id = self.resolve(session_id)
        store = self.store
        finished = []
        for call in self._isolated_waiting(session_id):
            res = run_call(store, session_id, call.field, self.runners.isolated, self.owner, "runIsolated")
            if res.finished is not None:
                finished.append(res.finished)
        self.driver.calls_ran(session_id, finished)
        return self.view(session_id)


def _step_or_run(step: bool, run: bool) -> None:
    """A new session or message is stepped once or driven on, not both (`start`, `send`)."""
    if step and run:
        raise InvalidInput("choose --step or --run, not both")


def check_prompt(query: UserQuery, max_bytes: int) -> None:
    """The one rule on a prompt (start, and any later message): not empty, text within the limit
    (attachments have their own, AGENTS_MEDIA_MAX_BYTES)."""
    if not query.text.strip() and not query.media:
        raise InvalidInput("the prompt is empty: give -p TEXT, --file PATH or --media PATH")
    size = len(query.text.encode(errors="surrogatepass"))
    if size > max_bytes:
        raise InvalidInput(f"the prompt is {size} bytes, more than the limit of {max_bytes} (AGENTS_MAX_PROMPT_BYTES)")


def _iso(seconds: float | None) -> str | None:
    """A time (seconds since the epoch) as ISO 8601 in UTC, to the millisecond."""
    if seconds is None:
        return None
    stamp = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _limit_problem(exc: Exception) -> str:
    """A bad KEY or limit, said as the option that is wrong."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        name = str(first["loc"][0]) if first.get("loc") else "limit"
        return f"--{name}: {first['msg'].lower()}"
    return str(exc)


def check_token_shape(token: str) -> None:
    """A session id (or a file name) where a token belongs gets a hint, not just "unknown"."""
    if "." not in token.strip() and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", token.strip()):
        text = token.strip()[:80]
        where = (
            f"`agents session pending {text}` lists the session's tokens"
            if re.fullmatch(r"[0-9a-f]{4,64}", text)  # a session id (or a prefix of one) given as a token
            else "`agents session pending` lists the tokens of every session waiting"
        )
        raise UnknownToken(f"{token[:80]!r} is not a token (a token is <session id>.<secret>); {where}", token=token)


def _arguments(raw: str) -> Any:
    """A model's call arguments as the call is tracked with them (its text when not JSON)."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


_WHOLE_ID = re.compile(r"^[0-9a-f]{32}$")
#: the longest wait `extend` gives a deferred call
MAX_EXTEND_SECONDS = 365 * 86400.0
_FINISHED = FINISHED_STATES
