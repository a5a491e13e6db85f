"""Fault-injection checkpoints for the chaos tests; inert unless AGENTS_FAULT_PAUSE is set.

With `AGENTS_FAULT_PAUSE=<name>`, a worker reaching checkpoint `<name>` records it in Redis
(`<prefix>:fault:<name>` = session id) and stops there, so a test can SIGKILL it at exactly that
point: after a model response is journaled, after a commit and before what follows is published.
"""

from __future__ import annotations

import os
import time

from celery_agents.store import Store

_PAUSE = os.environ.get("AGENTS_FAULT_PAUSE", "")


def checkpoint(name: str, store: Store, session_id: str) -> None:
    if not _PAUSE or name != _PAUSE:
        return
    store.client.set(store.keys.fault(name), session_id)
    time.sleep(float(os.environ.get("AGENTS_FAULT_PAUSE_SECONDS", "600")))
