"""Worker services: a thread in each worker's main process that sweeps owed steps (the outbox),
expires deadlines, and writes the worker's heartbeat. One worker sweeps at a time (a short lock).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from celery.signals import worker_init, worker_process_shutdown, worker_ready, worker_shutdown

from celery_agents import observe
from celery_agents.config import Settings, forget_keys
from celery_agents.errors import RedisRefused, RedisUnavailable
from celery_agents.model import build_schemas
from celery_agents.model.recovery import Recovery
from celery_agents.observe.logs import connect_celery
from celery_agents.runtime.completions import CompletionConsumer
from celery_agents.store import FINISHED_STATES, EmbeddedRedis, Store
from celery_agents.store.codec import STORED_TURN
from celery_agents.store.fleet import Turn
from celery_agents.store.outage import UNREACHABLE as STORE_UNREACHABLE
from celery_agents.tasks.celery_app import app, worker_settings
from celery_agents.tasks.config import CALL_TASK, ISOLATED_TASK, STEP_TASK, Dispatcher
from celery_agents.tasks.context import worker_context
from celery_agents.tasks.queues import QueueHead, QueueProbe

log = logging.getLogger("celery_agents.services")

#: Redis could not be reached: the loops try again at their next turn
UNREACHABLE: tuple[type[Exception], ...] = (RedisUnavailable, *STORE_UNREACHABLE)


def task_log_fields(task_name: str, args: Sequence[Any]) -> dict[str, Any]:
    """What a task's log lines are about: its session, and the step version or the call."""
    if task_name == STEP_TASK and len(args) >= 2:
        return {"session_id": str(args[0]), "version": args[1]}
    if task_name in (CALL_TASK, ISOLATED_TASK) and len(args) >= 2:
        return {"session_id": str(args[0]), "call": str(args[1])}
    return {}


# Session, step version and call on every line a worker logs; JSON lines under AGENTS_LOG_FORMAT=json
# (read when Celery sets up logging, not at import).
connect_celery(lambda: worker_settings().log_format == "json", task_log_fields)


def sweep_once(
    store: Store,
    dispatcher: Dispatcher,
    settings: Settings,
    now: float | None = None,
    probe: QueueProbe | None = None,
    recover: bool = True,
) -> dict[str, int]:
    """Publish again what nobody will run, and expire due deadlines; returns counts.

    An owed step (or dispatched call) is published again when a worker picked it up and its lease
    lapsed without an outcome (that worker died), or when it was never picked up and its message
    cannot be waiting in its queue: the queue is empty, or its oldest message was published after
    this entry was committed (queues are first in, first out) — the message was lost between
    commit and publish. At the latest it goes again after `lost_grace`. A message that may merely
    be waiting in a busy queue is left alone: duplicates would only add load. The decision
    (`model.recovery.recovery_decision`) and its bookkeeping are one script per entry
    (store/lua/sweep_*.lua): a published copy counts as not picked up, so it is not published
    again at every sweep while it waits in its queue. With `recover=False` (just after an outage:
    `AfterOutage`) it only expires deadlines."""
    now = store.server_time() if now is None else now  # owed and deadline scores are Redis times
    counts = {"owed": 0, "redispatched": 0}
    if recover:
        judge = _Judge(settings, now, _queue_heads(store, settings, now, probe))
        counts = {
            "owed": _sweep_owed(store, dispatcher, judge, now),
            "redispatched": _sweep_dispatched(store, dispatcher, judge, now),
        }
    return {**counts, "expired": _expire_deadlines(store, dispatcher, now), "warned": store.warn_due(now)}


class AfterOutage:
    """Whether the sweeper may take over owed steps and dispatched calls now.

    Leases lapse while Redis is away: their holders cannot renew them, and a restarted Redis drops
    the ones that expired meanwhile. For one lease after Redis is back (as this sweeper saw it, or
    after the server started: its uptime), a lapsed lease proves no worker dead, so nothing is
    republished; the holders, which waited the outage out, take their leases again meanwhile."""

    def __init__(self, lease_seconds: float) -> None:
        self.lease_seconds = lease_seconds
        self._away_since: float | None = None
        self._back_at = -lease_seconds

    def unreachable(self, exc: Exception) -> None:
        if self._away_since is None:
            self._away_since = time.monotonic()
            log.warning("worker services cannot reach Redis (%s): sweeping again once it is back", exc)

    def reached(self) -> None:
        if self._away_since is not None:
            now = time.monotonic()
            log.warning(
                "Redis is back after %.1f s: steps and calls whose leases lapsed are taken over after %g s more "
                "(their workers take their leases again first)",
                now - self._away_since,
                self.lease_seconds,
            )
            self._away_since, self._back_at = None, now

    def may_recover(self, store: Store) -> bool:
        if time.monotonic() < self._back_at + self.lease_seconds:
            return False
        uptime = store.redis_uptime()
        return uptime is None or uptime >= self.lease_seconds


@dataclass(frozen=True)
class _Judge:
    """Whether an entry never picked up is lost: its message cannot be in its queue."""

    settings: Settings
    now: float
    heads: dict[str, QueueHead]

    def lost(self, queue: str | None, committed_ms: float) -> bool:
        if committed_ms <= int((self.now - self.settings.lost_grace) * 1000):
            return True
        head = self.heads.get(queue, _UNKNOWN) if queue is not None else None
        # Publishing follows the commit within milliseconds; the margin absorbs clock skew between
        # the committing worker and the one that published the queue's oldest message.
        return head is None or head.cannot_hold(committed_ms, self.settings.clock_skew * 1000)


_UNKNOWN = QueueHead(None)


def _call_queue(disposition: str | None) -> str | None:
    """The queue a dispatched call waits in; a call that is gone waits in none known (judged by
    `lost_grace` alone), a disposition that is never queued in none at all (None: lost)."""
    if disposition is None:
        return ""
    # An approved runSync gate runs on the tools lane too (tasks/config.py `Dispatcher.call`).
    return {"runAsync": "tools", "runSync": "tools", "runIsolated": "isolated"}.get(disposition)


def _queue_heads(store: Store, settings: Settings, now: float, probe: QueueProbe | None) -> dict[str, QueueHead]:
    """The queues' heads, read only when something is due, and before the candidates: a message
    taken from its queue meanwhile then still counts as possibly waiting, never as lost."""
    if not store.anything_due(now - settings.owed_grace):
        return {}
    own = probe is None
    probe = probe or QueueProbe(settings, store.queue_lists())
    try:
        return probe.heads(["steps", "tools", "isolated"])
    finally:
        if own:
            probe.close()


def _sweep_owed(store: Store, dispatcher: Dispatcher, judge: _Judge, now: float) -> int:
    owed = store.owed_due(now - judge.settings.owed_grace)
    if not owed:
        return 0
    candidates = [(sid, judge.lost("steps", committed_ms)) for sid, committed_ms in owed]
    published = 0
    for swept in store.sweep_owed(candidates, now):  # counted (republished, takeovers) by its script
        if swept.verdict is Recovery.REPUBLISH:
            dispatcher.step(swept.session_id, swept.version, request="sweeper", priority=swept.priority)
            published += 1
    return published


def _sweep_dispatched(store: Store, dispatcher: Dispatcher, judge: _Judge, now: float) -> int:
    due = store.dispatched_due(now - judge.settings.owed_grace)
    if not due:
        return 0
    candidates = [(c.session_id, c.field, judge.lost(_call_queue(c.disposition), c.committed_ms)) for c in due]
    published = 0
    for swept in store.sweep_dispatched(candidates, now):  # counted (republished, takeovers) by its script
        if swept.verdict is Recovery.REPUBLISH and swept.call is not None:
            dispatcher.call(swept.session_id, swept.call)
            published += 1
    return published


def _expire_deadlines(store: Store, dispatcher: Dispatcher, now: float) -> int:
    expired = 0
    for sid, finished in store.expire_due(now):
        if finished.status == "ok":
            expired += 1
            if finished.woken:
                dispatcher.step(sid, finished.version, "expired", priority=finished.priority)
    return expired


#: Sessions deleted per sweep at most under AGENTS_RETENTION_DAYS: a backlog drains over many
#: sweeps instead of holding Redis in one long burst.
PURGE_PER_SWEEP = 5


def purge_expired(store: Store, settings: Settings) -> int:
    """Delete a few finished sessions older than the retention (off unless AGENTS_RETENTION_DAYS)."""
    if settings.retention_days is None:
        return 0
    cutoff = store.server_time() - settings.retention_days * 86400
    return len(store.purge(list(FINISHED_STATES), cutoff, PURGE_PER_SWEEP))


class WorkerServices:
    def __init__(self, settings: Settings, name: str, queues: list[str]) -> None:
        self.settings = settings
        self.name = name
        self.queues = queues
        self._stop = threading.Event()
        self._sandbox_info: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._loop, name="celery-agents-services", daemon=True)
        self._consumer = threading.Thread(target=self._consume, name="celery-agents-completions", daemon=True)

    @property
    def started(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()
        self._consumer.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._consumer.join(timeout=5)
        with contextlib.suppress(Exception):  # Redis gone: the heartbeat ages out on its own
            worker_context(self.settings).store.forget_worker(self.name)

    def _loop(self) -> None:
        dispatcher = Dispatcher(app)
        probe: QueueProbe | None = None
        outage = AfterOutage(self.settings.lease_seconds)
        while not self._stop.is_set():
            try:
                # Not waiting out an outage: the next sweep, a second later, tries again anyway.
                store = worker_context(self.settings).store.at_once()
                probe = probe or QueueProbe(self.settings, store.queue_lists())
                now = store.server_time()  # heartbeats are compared by other hosts: Redis's clock
                store.beat(self.name, self._beat(now))
                outage.reached()
                # The turn lapses before the next sweep: whichever worker comes first sweeps then.
                if store.take_sweep_turn(self.name, self.settings.sweep_interval * 0.9):
                    counts = sweep_once(store, dispatcher, self.settings, now, probe, outage.may_recover(store))
                    counts["purged"] = purge_expired(store, self.settings)
                    if any(counts.values()):
                        log.info("sweep: %s", counts)
            except UNREACHABLE as exc:
                outage.unreachable(exc)
            except Exception:
                log.exception("worker services sweep failed")
            self._stop.wait(self.settings.sweep_interval)
        if probe is not None:
            probe.close()

    def _beat(self, now: float) -> dict[str, Any]:
        beat: dict[str, Any] = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "at": now,
            "queues": self.queues,
            "retention_days": self.settings.retention_days,
        }
        if "isolated" in self.queues:
            beat["sandbox"] = self._sandbox()
        return beat

    def _sandbox(self) -> dict[str, Any]:
        """How this worker's runIsolated calls are confined (probed once), for `agents doctor`."""
        if self._sandbox_info is None:
            from celery_agents.tools.sandbox import Sandbox

            box = Sandbox()
            how = box.containment()  # None: every isolated call here fails, saying why
            self._sandbox_info = {
                "contained": how is not None,
                "bubblewrap": how == "bwrap",
                "namespaces": how == "namespaces",
                "own_uid": os.geteuid() == 0 and box.config.uid != "off",
                "run_cgroup": box.cgroups.available(),
            }
            if how is None:
                log.error("%s", box.cannot_contain())
            else:
                log.info(
                    "runIsolated calls here get: rlimits%s%s, %s",
                    ", a uid per call" if self._sandbox_info["own_uid"] else "",
                    ", a cgroup per call" if self._sandbox_info["run_cgroup"] else "",
                    "bubblewrap" if how == "bwrap" else "namespaces of their own (no bubblewrap)",
                )
            if how is None:
                self._sandbox_info["why"] = box.cannot_contain()
        return self._sandbox_info

    def _consume(self) -> None:
        """Apply completions other systems XADD to the `completions` stream, as they arrive.

        One worker at a time consumes (a lock renewed while it does), so entries are applied in
        stream order: of two completions of one token, the first written wins. Another worker takes
        over within seconds, applying first what the previous one had read but not acknowledged."""
        dispatcher = Dispatcher(app)
        consumer: CompletionConsumer | None = None
        turn: Turn | None = None
        away = False
        while not self._stop.is_set():
            try:
                store = worker_context(self.settings).store
                turn = turn or store.completions_turn(self.name)
                if not turn.hold():
                    consumer = None
                    self._stop.wait(0.5)
                    continue
                if consumer is None:
                    consumer = CompletionConsumer(
                        store,
                        self.name,
                        wake=lambda sid, v, p: dispatcher.step(sid, v, "wake", priority=p),
                        dispatch=dispatcher.call,
                    )
                consumer.poll(block_ms=250)  # short: a stopping worker waits for it
                away = False
            except UNREACHABLE as exc:
                # Its reads fail at once; what it had read is applied through the outage or, past
                # it, taken over (pending in the group) by the consumer made next.
                if not away:
                    log.warning("completions: cannot reach Redis (%s); reading again once it is back", exc)
                away, consumer = True, None
                self._stop.wait(1.0)
            except Exception:
                log.exception("applying completions failed; retrying")
                consumer = None
                self._stop.wait(1.0)
        if turn is not None:
            with contextlib.suppress(Exception):  # expired or Redis gone: it lapses on its own
                turn.let_go()


_services: WorkerServices | None = None
_embedded: EmbeddedRedis | None = None
#: set in a Celery worker run by `agents worker` (tasks/supervisor.py): "steps" or "tools"; the
#: supervisor holds the services and the embedded Redis, the child only serves its queues
_child_role: str | None = None


def run_as_child(role: str) -> None:
    """This process is a Celery worker under `agents worker`'s supervisor, serving `role`."""
    global _child_role
    _child_role = role


@contextlib.contextmanager
def worker_resources(settings: Settings) -> Iterator[None]:
    """What a worker holds for its whole life: the embedded Redis (no `AGENTS_REDIS_URL`), and a
    state Redis checked for an eviction policy that could drop sessions."""
    embedded = EmbeddedRedis(settings.home).acquire() if settings.embedded else None
    try:
        store = worker_context(settings).store
        store.check_eviction()
        store.check_format()
        yield
    finally:
        if embedded is not None:
            embedded.release()


# Celery is untyped: its decorators would leave the handlers untyped.
@worker_init.connect  # type: ignore[untyped-decorator]
def _on_worker_init(**_: Any) -> None:
    global _embedded
    from celery_agents.tools.sandbox import protect_process

    # Before anything else: the worker's keys in its /proc/<pid>/environ are out of reach of tools
    # running as its user (the pool processes forked from here inherit it).
    protect_process()
    settings = worker_settings()
    # The keys now live in `settings` alone: no tool of this Celery worker (nor its pool processes,
    # forked later) inherits them. `agents worker`'s supervisor keeps them for the workers it
    # starts; it runs no tool.
    forget_keys()
    if _child_role is None:
        if settings.embedded:
            _embedded = EmbeddedRedis(settings.home).acquire()
        try:
            store = worker_context(settings).store
            store.check_eviction()
            store.check_format()
        except (RedisUnavailable, RedisRefused) as exc:
            # Celery logs and ignores what a worker_init handler raises, except SystemExit.
            log.critical("refusing to start: %s", exc.message)
            raise SystemExit(2) from exc
    if _child_role != "tools":  # a worker that runs no step never calls a model
        # Imported once in the parent so that forked pool processes share it.
        from celery_agents.llm.adapter import warm_up

        warm_up()
    build_schemas()
    STORED_TURN.rebuild()
    # What is loaded by now lives as long as the process: keep it out of the collector's sight.
    # Forked pool processes then share those pages instead of copying them when a collection
    # touches them, and a stopping process skips collecting them (exit ~1.3 s → ~0.05 s each).
    gc.collect()
    gc.freeze()


@worker_ready.connect  # type: ignore[untyped-decorator]
def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    global _services
    if _child_role is not None:
        return
    name = getattr(sender, "hostname", None) or f"worker@{socket.gethostname()}:{os.getpid()}"
    queues = sorted(q.name for q in app.amqp.queues.consume_from.values()) if app.amqp.queues.consume_from else []
    _services = WorkerServices(worker_settings(), name, queues)
    _services.start()


@worker_shutdown.connect  # type: ignore[untyped-decorator]
def _on_worker_shutdown(**_: Any) -> None:
    global _embedded
    if _services is not None:
        _services.stop()
    if _embedded is not None:
        _embedded.release()
        _embedded = None


@worker_process_shutdown.connect  # type: ignore[untyped-decorator]
def _on_process_shutdown(**_: Any) -> None:
    observe.flush()  # a pool process's spans still buffered
