"""Keeping a step's session lease alive while the step runs (a thread renews it)."""

from __future__ import annotations

import threading
from types import TracebackType

from celery_agents.store import Store


class LeaseKeeper:
    """Renews the lease every third of its length until the block ends."""

    def __init__(self, store: Store, session_id: str, owner: str) -> None:
        self.store, self.session_id, self.owner = store, session_id, owner
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False

    def _renew(self) -> None:
        interval = max(0.05, self.store.settings.lease_seconds / 3)
        while not self._stop.wait(interval):
            try:
                if not self.store.renew_lease(self.session_id, self.owner):
                    self.lost = True
                    return
            except Exception:  # Redis blips: the commit's checks decide in the end
                continue

    def __enter__(self) -> LeaseKeeper:
        self._thread = threading.Thread(target=self._renew, name=f"lease-{self.session_id[:8]}", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
