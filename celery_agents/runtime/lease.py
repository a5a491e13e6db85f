"""Keeping leases alive while their holders work (a step's session lease, a dispatched call's
lease), noticing when the work is no longer wanted (its session was cancelled), and telling a step
whether it may still act under its lease.

One thread per process renews every lease held in that process, so a step pays a dictionary insert,
not a thread start. A lease whose renewal was sent at (monotonic) time t is trusted by its holder
until t + lease - margin, the margin a third of the lease: a step asks `holds()` before each model
call, tool call and commit, and once that deadline has passed (its process was frozen, Redis was
away, the renewal thread fell behind) it renews the lease itself first, instead of trusting a
`lost` flag that the renewal thread, after a freeze, may set only after the step has acted. The
renewals stay a third of a lease apart, so the deadline is two of them ahead: a step renews on its
own only when the thread has missed a whole one.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

from celery_agents.store import Store
from celery_agents.store.records import LeaseRef, Renewal

log = logging.getLogger("celery_agents.lease")

_TICK = 0.25
#: the part of a lease its holder does not count on: trusted for the rest after each renewal
MARGIN = 1 / 3


@dataclass
class _Held:
    store: Store
    ref: LeaseRef
    still_wanted: Callable[[], bool] | None
    #: until when (monotonic) the lease is surely held: the last renewal's start + lease - margin
    valid_until: float
    cancel: threading.Event = field(default_factory=threading.Event)
    next_renew: float = 0.0
    lost: bool = False
    #: the lease lapsed under its holder (Redis was away longer than it) and was taken again
    retaken: bool = False

    def renewed(self, sent: float, outcome: Renewal) -> None:
        """Apply what a renewal sent at `sent` found."""
        if outcome == "lost":
            self.lost = True
            if self.still_wanted is not None:
                # A dispatched call's lease another worker holds now (this one was frozen past
                # it): that worker runs the call; this copy is stopped, and its outcome refused.
                self.cancel.set()
            return
        trusted = sent + self.store.settings.lease_seconds * (1 - MARGIN)
        self.valid_until = max(self.valid_until, trusted)
        self.retaken = self.retaken or outcome == "retaken"


def _interval(store: Store) -> float:
    return max(0.05, store.settings.lease_seconds / 3)


class _Renewer:
    """The process's renewal thread, started on first use."""

    def __init__(self) -> None:
        self.held: dict[int, _Held] = {}
        self.lock = threading.Lock()
        #: notified when a batch of renewals has come back
        self.returned = threading.Condition(self.lock)
        #: leases whose renewal is on its way to Redis
        self.in_flight: set[int] = set()
        self.ids = itertools.count()
        self.thread: threading.Thread | None = None

    def add(self, held: _Held) -> int:
        with self.lock:
            n = next(self.ids)
            self.held[n] = held
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._loop, name="lease-renewer", daemon=True)
                self.thread.start()
            return n

    def remove(self, n: int, wait: float) -> None:
        """Stop renewing lease `n`; a renewal of it already on its way is waited for (up to `wait`
        seconds), so that none lands after its holder let the lease go and takes it again."""
        with self.returned:
            self.held.pop(n, None)
            self.returned.wait_for(lambda: n not in self.in_flight, timeout=wait)

    def _loop(self) -> None:
        tick = _TICK
        while True:
            time.sleep(tick)
            with self.lock:
                current = list(self.held.items())
            # Short leases (tests) are renewed as often as they need.
            tick = min([_TICK] + [max(0.02, h.store.settings.lease_seconds / 3) for _, h in current])
            now = time.monotonic()
            due: dict[int, list[tuple[int, _Held]]] = {}
            for n, h in current:
                try:
                    if h.still_wanted is not None and not h.cancel.is_set() and not h.still_wanted():
                        h.cancel.set()
                except Exception:  # Redis blips: asked again next tick
                    pass
                if now >= h.next_renew:
                    h.next_renew = now + _interval(h.store)
                    due.setdefault(id(h.store), []).append((n, h))
            # All the leases one store holds are renewed in one round trip, however many there are.
            for batch in due.values():
                self._renew(batch)

    def _renew(self, batch: list[tuple[int, _Held]]) -> None:
        ids = {n for n, _ in batch}
        with self.lock:
            self.in_flight |= ids
        sent = time.monotonic()
        try:
            outcomes = batch[0][1].store.renew_leases([h.ref for _, h in batch])
        except Exception:  # Redis blips: the holders' own checks and the commit decide in the end
            for _, h in batch:
                h.next_renew = sent  # tried again next tick
            return
        finally:
            with self.returned:
                self.in_flight -= ids
                self.returned.notify_all()
        for (_, h), outcome in zip(batch, outcomes, strict=True):
            h.renewed(sent, outcome)
        retaken = outcomes.count("retaken")
        if retaken:
            log.warning("%s leases had lapsed while their holders could not renew them: taken again", retaken)


_renewer: _Renewer | None = None
_renewer_pid = 0
#: steps in many threads may take their first leases at once: one renewer per process
_renewer_lock = threading.Lock()


def _reset_after_fork() -> None:
    """A forked child starts with its own lock (another thread may have held the parent's)."""
    global _renewer_lock
    _renewer_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def _process_renewer() -> _Renewer:
    global _renewer, _renewer_pid
    with _renewer_lock:
        if _renewer is None or _renewer_pid != os.getpid():  # a forked child needs its own thread
            _renewer, _renewer_pid = _Renewer(), os.getpid()
        return _renewer


class LeaseKeeper:
    """Renews a lease (`key`, held by `owner`) every third of its length until the block ends, and
    says whether its holder may still act under it (`holds`). A step's lease names its session's
    `header` and the step's `version`; `taken_at` is when the lease was asked for (monotonic).
    `slot`: a model call's slot under a concurrency limit (`key` its KEY's slots in flight);
    `claim`: a step's claim on a budget above it (`key` that session's claims, `owner` its member).

    With `still_wanted` (a dispatched call's lease), it also asks every quarter second whether the
    work should go on, and sets `cancel` when not, or when the lease is found another's (the tool
    runner kills the call's processes on that event)."""

    def __init__(
        self,
        store: Store,
        key: str,
        owner: str,
        still_wanted: Callable[[], bool] | None = None,
        *,
        header: str = "",
        version: int = 0,
        taken_at: float | None = None,
        slot: bool = False,
        claim: bool = False,
    ) -> None:
        taken = time.monotonic() if taken_at is None else taken_at
        self._held = _Held(
            store,
            LeaseRef(key, owner, header, version, slot, claim),
            still_wanted,
            valid_until=taken + store.settings.lease_seconds * (1 - MARGIN),
            next_renew=taken + _interval(store),
        )
        self._id: int | None = None
        self._renewer: _Renewer | None = None

    @property
    def cancel(self) -> threading.Event:
        return self._held.cancel

    @property
    def lost(self) -> bool:
        return self._held.lost

    @property
    def retaken(self) -> bool:
        """The lease lapsed under its holder and was taken again: others may have acted meanwhile."""
        return self._held.retaken

    def holds(self) -> bool:
        """Whether the holder may act under the lease now: until its local deadline, yes; past it,
        once the lease is renewed (or taken again) in Redis, waiting out an outage up to the store's
        bound (`RedisUnavailable` after it). False once it is lost."""
        h = self._held
        if not h.lost and time.monotonic() >= h.valid_until:
            sent = time.monotonic()
            [outcome] = h.store.through_outage(lambda: h.store.renew_leases([h.ref]))
            h.renewed(sent, outcome)
        return not h.lost

    def __enter__(self) -> LeaseKeeper:
        # Removed later from this very renewer: ids are only unique within one.
        self._renewer = _process_renewer()
        self._id = self._renewer.add(self._held)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._renewer is not None and self._id is not None:
            self._renewer.remove(self._id, wait=self._held.store.settings.lease_seconds)
