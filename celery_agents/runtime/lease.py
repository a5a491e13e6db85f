"""Keeping leases alive while their holders work (a step's session lease, a dispatched call's
lease), and noticing when the work is no longer wanted (its session was cancelled).

One thread per process renews every lease held in that process, so a step pays a dictionary insert,
not a thread start.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

from celery_agents.store import Store

_TICK = 0.25


@dataclass
class _Held:
    store: Store
    key: str
    owner: str
    still_wanted: Callable[[], bool] | None
    cancel: threading.Event = field(default_factory=threading.Event)
    next_renew: float = 0.0
    lost: bool = False


class _Renewer:
    """The process's renewal thread, started on first use."""

    def __init__(self) -> None:
        self.held: dict[int, _Held] = {}
        self.lock = threading.Lock()
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

    def remove(self, n: int) -> None:
        with self.lock:
            self.held.pop(n, None)

    def _loop(self) -> None:
        tick = _TICK
        while True:
            time.sleep(tick)
            with self.lock:
                current = list(self.held.values())
            # Short leases (tests) are renewed as often as they need.
            tick = min([_TICK] + [max(0.02, h.store.settings.lease_seconds / 3) for h in current])
            now = time.monotonic()
            due: dict[int, list[_Held]] = {}
            for h in current:
                try:
                    if h.still_wanted is not None and not h.cancel.is_set() and not h.still_wanted():
                        h.cancel.set()
                except Exception:  # Redis blips: asked again next tick
                    pass
                if now >= h.next_renew:
                    h.next_renew = now + max(0.05, h.store.settings.lease_seconds / 3)
                    due.setdefault(id(h.store), []).append(h)
            # All the leases one store holds are renewed in one round trip, however many there are.
            for batch in due.values():
                try:
                    renewed = batch[0].store.renew_leases([(h.key, h.owner) for h in batch])
                except Exception:  # Redis blips: the commit's checks decide in the end
                    for h in batch:
                        h.next_renew = now  # tried again next tick
                    continue
                for h, ok in zip(batch, renewed, strict=True):
                    if not ok:
                        h.lost = True


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
    """Renews a lease (`key`, held by `owner`) every third of its length until the block ends.

    With `still_wanted`, it also asks every quarter second whether the work should go on, and sets
    `cancel` when not (the tool runner kills the call's processes on that event)."""

    def __init__(self, store: Store, key: str, owner: str, still_wanted: Callable[[], bool] | None = None) -> None:
        self._held = _Held(
            store, key, owner, still_wanted, next_renew=time.monotonic() + max(0.05, store.settings.lease_seconds / 3)
        )
        self._id: int | None = None
        self._renewer: _Renewer | None = None

    @property
    def cancel(self) -> threading.Event:
        return self._held.cancel

    @property
    def lost(self) -> bool:
        return self._held.lost

    def __enter__(self) -> LeaseKeeper:
        # Removed later from this very renewer: ids are only unique within one.
        self._renewer = _process_renewer()
        self._id = self._renewer.add(self._held)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._renewer is not None and self._id is not None:
            self._renewer.remove(self._id)
