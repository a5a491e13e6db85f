"""Keeping a lease alive while its holder works (a step's session lease, a dispatched call's
lease), and noticing when the work is no longer wanted (its session was cancelled)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType

from celery_agents.store import Store


class LeaseKeeper:
    """Renews a lease (`key`, held by `owner`) every third of its length until the block ends.

    With `still_wanted`, it also asks every `watch_interval` seconds whether the work should go on,
    and sets `cancel` when not (the tool runner kills the call's processes on that event)."""

    def __init__(
        self,
        store: Store,
        key: str,
        owner: str,
        still_wanted: Callable[[], bool] | None = None,
        watch_interval: float = 0.25,
    ) -> None:
        self.store, self.key, self.owner = store, key, owner
        self.still_wanted = still_wanted
        self.watch_interval = watch_interval
        self.cancel = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False

    def _loop(self) -> None:
        renew_every = max(0.05, self.store.settings.lease_seconds / 3)
        tick = min(renew_every, self.watch_interval) if self.still_wanted else renew_every
        next_renew = time.monotonic() + renew_every
        while not self._stop.wait(tick):
            try:
                if self.still_wanted is not None and not self.cancel.is_set() and not self.still_wanted():
                    self.cancel.set()
                if time.monotonic() >= next_renew:
                    next_renew = time.monotonic() + renew_every
                    if not self.store.renew_lease(self.key, self.owner):
                        self.lost = True
            except Exception:  # Redis blips: the commit's checks decide in the end
                continue

    def __enter__(self) -> LeaseKeeper:
        self._thread = threading.Thread(target=self._loop, name="lease-keeper", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
