"""Worker services: a thread in each worker's main process that sweeps owed steps (the outbox),
expires deadlines, and writes the worker's heartbeat. One worker sweeps at a time (a short lock).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any, cast

from celery.signals import worker_init, worker_ready, worker_shutdown
from redis.exceptions import LockError
from redis.lock import Lock

from celery_agents.config import Settings
from celery_agents.errors import RedisUnavailable
from celery_agents.model import TrackedCall, build_schemas
from celery_agents.runtime.completions import CompletionConsumer
from celery_agents.store import FINISHED_STATES, EmbeddedRedis, Store
from celery_agents.tasks.celery_app import app, settings
from celery_agents.tasks.config import Dispatcher
from celery_agents.tasks.context import worker_context
from celery_agents.tasks.queues import QueueHead, QueueProbe
from celery_agents.tasks.recycle import mark_supervised

log = logging.getLogger("celery_agents.services")


def sweep_once(
    store: Store, dispatcher: Dispatcher, settings: Settings, now: float | None = None, probe: QueueProbe | None = None
) -> dict[str, int]:
    """Publish again what nobody will run, and expire due deadlines; returns counts.

    An owed step (or dispatched call) is published again when a worker picked it up and its lease
    lapsed without an outcome (that worker died), or when it was never picked up and its message
    cannot be waiting in its queue: the queue is empty, or its oldest message was published after
    this entry was committed (queues are first in, first out) — the message was lost between
    commit and publish. At the latest it goes again after `lost_grace`. A message that may merely
    be waiting in a busy queue is left alone: duplicates would only add load. The decision and its
    bookkeeping are one script per entry (store/lua/sweep_*.lua): a published copy counts as not
    picked up, so it is not published again at every sweep while it waits in its queue."""
    now = store.server_time() if now is None else now  # owed and deadline scores are Redis times
    counts = {"owed": 0, "redispatched": 0, "expired": 0}
    k = store.keys
    r = store.client
    cutoff, lost_cutoff = int((now - settings.owed_grace) * 1000), int((now - settings.lost_grace) * 1000)
    # Publishing follows the commit within milliseconds; the margin absorbs clock skew between the
    # committing worker and the one that published the queue's oldest message.
    margin_ms = int(settings.skew_margin * 1000)

    heads: dict[str, QueueHead] = {}
    pipe = r.pipeline(transaction=False)
    pipe.zcount(k.owed, "-inf", cutoff)
    pipe.zcount(k.dispatched, "-inf", cutoff)
    if any(pipe.execute()):
        # Read before the candidates: a message taken from its queue meanwhile then still counts
        # as possibly waiting, never as lost.
        own_probe = probe is None
        probe = probe or QueueProbe(settings, r)
        heads = probe.heads(["steps", "tools", "isolated"])
        if own_probe:
            probe.close()

    # The client decodes replies (store/connection.py): members are `str`, where redis-py says `bytes | str`.
    owed = cast("list[tuple[str, float]]", r.zrangebyscore(k.owed, "-inf", cutoff, start=0, num=200, withscores=True))
    if owed:
        waiting = heads.get("steps", QueueHead(None))
        lost = [(sid, waiting.cannot_hold(score, margin_ms) or score <= lost_cutoff) for sid, score in owed]
        for swept in store.sweep_owed(lost, now):
            if swept.verdict == "republish":
                dispatcher.step(swept.session_id, swept.version, request="sweeper")
                counts["owed"] += 1

    dispatched = cast(
        "list[tuple[str, float]]", r.zrangebyscore(k.dispatched, "-inf", cutoff, start=0, num=200, withscores=True)
    )
    if dispatched:
        # Which queue a call waits in depends on its disposition: read the calls first.
        members = [(*member.split(" ", 1), score) for member, score in dispatched]
        rows = cast("list[tuple[str, str, float]]", members)  # members are "<session id> <field>"
        pipe = r.pipeline(transaction=False)
        for sid, field, _ in rows:
            pipe.hget(k.calls(sid), field)
        raws = pipe.execute()
        unknown = QueueHead(None)
        by_disposition = {"runAsync": heads.get("tools", unknown), "runIsolated": heads.get("isolated", unknown)}
        candidates = []
        for (sid, field, score), raw in zip(rows, raws, strict=True):
            head = by_disposition.get(TrackedCall.model_validate_json(raw).disposition) if raw else unknown
            candidates.append((sid, field, head is None or head.cannot_hold(score, margin_ms) or score <= lost_cutoff))
        for swept in store.sweep_dispatched(candidates, now):
            if swept.verdict == "republish" and swept.call is not None:
                dispatcher.call(swept.session_id, swept.call)
                counts["redispatched"] += 1

    for sid, finished in store.expire_due(now):
        if finished.status == "ok":
            counts["expired"] += 1
            if finished.woken:
                dispatcher.step(sid, finished.version, "expired")
    return counts


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
        try:
            store = worker_context(self.settings).store
            store.client.hdel(store.keys.workers, self.name)
        except Exception:
            pass

    def _loop(self) -> None:
        dispatcher = Dispatcher(app)
        probe: QueueProbe | None = None
        while not self._stop.is_set():
            try:
                store = worker_context(self.settings).store
                probe = probe or QueueProbe(self.settings, store.client)
                now = store.server_time()  # heartbeats are compared by other hosts: Redis's clock
                beat = {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "at": now,
                    "queues": self.queues,
                    "retention_days": self.settings.retention_days,
                }
                if "isolated" in self.queues:
                    beat["sandbox"] = self._sandbox()
                store.client.hset(store.keys.workers, self.name, json.dumps(beat))
                lock_ms = max(100, int(self.settings.sweep_interval * 900))
                if store.client.set(store.keys.lock("sweeper"), self.name, nx=True, px=lock_ms):
                    counts = sweep_once(store, dispatcher, self.settings, now, probe)
                    counts["purged"] = purge_expired(store, self.settings)
                    if any(counts.values()):
                        log.info("sweep: %s", counts)
            except Exception:
                log.exception("worker services sweep failed")
            self._stop.wait(self.settings.sweep_interval)
        if probe is not None:
            probe.close()

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
        lock: Lock | None = None
        held = False
        while not self._stop.is_set():
            try:
                store = worker_context(self.settings).store
                lock = lock or store.lock(store.keys.lock("completions"), seconds=5.0)
                held = _hold(lock, held, self.name)
                if not held:
                    consumer = None
                    self._stop.wait(0.5)
                    continue
                if consumer is None:
                    consumer = CompletionConsumer(
                        store, self.name, wake=lambda sid, v: dispatcher.step(sid, v, "wake"), dispatch=dispatcher.call
                    )
                consumer.poll(block_ms=250)  # short: a stopping worker waits for it
            except Exception:
                log.exception("applying completions failed; retrying")
                consumer = None
                self._stop.wait(1.0)
        if lock is not None and held:
            with contextlib.suppress(Exception):  # expired or Redis gone: it lapses on its own
                lock.release()


def _hold(lock: Lock, held: bool, name: str) -> bool:
    """Keep (extend) or take the lock; False when another worker holds it."""
    if held:
        try:
            return bool(lock.reacquire())
        except LockError:  # it lapsed while this worker stalled: whoever took it consumes now
            return False
    return bool(lock.acquire(blocking=False, token=name))


_services: WorkerServices | None = None
_embedded: EmbeddedRedis | None = None
#: set in a Celery worker run by `agents worker` (tasks/supervisor.py): "steps" or "tools"; the
#: supervisor holds the services and the embedded Redis, the child only serves its queues
_child_role: str | None = None


def run_as_child(role: str) -> None:
    """This process is a Celery worker under `agents worker`'s supervisor, serving `role`."""
    global _child_role
    _child_role = role
    mark_supervised()


@contextlib.contextmanager
def worker_resources(settings: Settings) -> Iterator[None]:
    """What a worker holds for its whole life: the embedded Redis (no `AGENTS_REDIS_URL`), and a
    state Redis checked for an eviction policy that could drop sessions."""
    embedded = EmbeddedRedis(settings.home).acquire() if settings.embedded else None
    try:
        worker_context(settings).store.check_eviction()
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
    if _child_role is None:
        if settings.embedded:
            _embedded = EmbeddedRedis(settings.home).acquire()
        try:
            worker_context(settings).store.check_eviction()
        except RedisUnavailable as exc:
            # Celery logs and ignores what a worker_init handler raises, except SystemExit.
            log.critical("refusing to start: %s", exc.message)
            raise SystemExit(2) from exc
    if _child_role != "tools":  # a worker that runs no step never calls a model
        # Imported once in the parent so that forked pool processes share it.
        from celery_agents.llm.adapter import warm_up

        warm_up()
    build_schemas()
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
    _services = WorkerServices(settings, name, queues)
    _services.start()


@worker_shutdown.connect  # type: ignore[untyped-decorator]
def _on_worker_shutdown(**_: Any) -> None:
    global _embedded
    if _services is not None:
        _services.stop()
    if _embedded is not None:
        _embedded.release()
        _embedded = None
