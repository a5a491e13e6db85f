"""Keeping a lease alive while its holder works: a step's session lease, a dispatched call's lease."""

from __future__ import annotations

import threading
from types import TracebackType

from celery_agents.store import Store


class LeaseKeeper:
    """Renews a lease (`key`, held by `owner`) every third of its length until the block ends."""

    def __init__(self, store: Store, key: str, owner: str) -> None:
        self.store, self.key, self.owner = store, key, owner
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False

    def _renew(self) -> None:
        interval = max(0.05, self.store.settings.lease_seconds / 3)
        while not self._stop.wait(interval):
            try:
                if not self.store.renew_lease(self.key, self.owner):
                    self.lost = True
                    return
            except Exception:  # Redis blips: the commit's checks decide in the end
                continue

    def __enter__(self) -> LeaseKeeper:
        self._thread = threading.Thread(target=self._renew, name="lease-keeper", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
