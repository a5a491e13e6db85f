"""Live output: the pieces of a model answer written to the session's events while it streams, and
the interrupts that `session send --interrupt` publishes.

Deltas are plain stream entries (`text_delta`, `reasoning_delta`, data `{"text", "offset"}`),
written without trimming the stream (a long answer must not push the session's real events out of
its cap) and deleted by the commit of their step (`commit_step.lua`), so a session's stream holds
them only while its step runs. They are not the transcript: a delta lost or left behind by a worker
that died loses nothing.

An interrupt is a message on the channel `<prefix>:interrupts`, `<session id> <version> <queued>`
(the session's version and how many messages wait once the interrupting one is queued), published
by `send_message.lua` in the script that queues the message. Each process that runs steps listens
on one connection (`InterruptListener`, started by the first step that watches); a step watches its
session from before it loads the session until it ends, so a message queued after its load is heard.
A notice lost while the listener reconnects costs nothing but the interrupt: the message is queued,
and the next model call takes it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from celery_agents.store.core import StoreCore

log = logging.getLogger("celery_agents.store")

#: (event type, text, offset of the text in the answer so far)
Delta = tuple[str, str, int]

#: how long the listener waits before it connects again after losing Redis (s, doubled up to 5 s)
_RECONNECT_S = 0.1


class InterruptWatch:
    """The interrupts of one session heard while a step of it runs: (version, messages queued)."""

    def __init__(self, listener: InterruptListener, session_id: str) -> None:
        self.listener, self.session_id = listener, session_id
        self.notices: list[tuple[int, int]] = []
        self._callbacks: list[Callable[[int, int], None]] = []
        self._lock = threading.Lock()

    def heard(self, version: int, queued: int) -> None:
        with self._lock:
            self.notices.append((version, queued))
            callbacks = list(self._callbacks)
        for callback in callbacks:
            callback(version, queued)

    def on_notice(self, callback: Callable[[int, int], None]) -> None:
        """Call `callback(version, queued)` for each notice from now on, and for those heard already."""
        with self._lock:
            self._callbacks.append(callback)
            heard = list(self.notices)
        for version, queued in heard:
            callback(version, queued)

    def close(self) -> None:
        self.listener.forget(self)


class InterruptListener:
    """One pub/sub connection of this process on the interrupts channel, on a daemon thread."""

    def __init__(self, client: redis.Redis, channel: str) -> None:
        self.client, self.channel = client, channel
        self._lock = threading.Lock()
        self._watches: dict[str, list[InterruptWatch]] = {}
        self._subscribed = threading.Event()
        self._pid = os.getpid()
        self._thread: threading.Thread | None = None

    def watch(self, session_id: str, wait_s: float = 2.0) -> InterruptWatch:
        """Hear the session's interrupts from now on. The watch that starts the listener waits, up
        to `wait_s`, until the channel is subscribed; later ones never wait (a listener that cannot
        subscribe, e.g. for want of an ACL permission, costs a step nothing)."""
        first = self._ensure_started()
        w = InterruptWatch(self, session_id)
        with self._lock:
            self._watches.setdefault(session_id, []).append(w)
        if first:
            self._subscribed.wait(wait_s)
        return w

    def forget(self, w: InterruptWatch) -> None:
        with self._lock:
            rest = [x for x in self._watches.get(w.session_id, []) if x is not w]
            if rest:
                self._watches[w.session_id] = rest
            else:
                self._watches.pop(w.session_id, None)

    def _ensure_started(self) -> bool:
        """Start the listening thread unless it runs; True when this call started it first."""
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's thread is not here
                self._pid, self._thread, self._watches = os.getpid(), None, {}
                self._subscribed = threading.Event()
            if self._thread is not None and self._thread.is_alive():
                return False
            first = self._thread is None
            self._thread = threading.Thread(target=self._listen, name="agents-interrupts", daemon=True)
            self._thread.start()
            return first

    def _listen(self) -> None:
        delay = _RECONNECT_S
        while True:
            pubsub: Any = None
            try:
                pubsub = self.client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
                pubsub.subscribe(self.channel)
                while True:
                    message = pubsub.get_message(timeout=1.0)
                    if pubsub.subscribed:
                        self._subscribed.set()
                        delay = _RECONNECT_S
                    if message is not None and message.get("type") == "message":
                        self._deliver(message.get("data"))
            except Exception as exc:  # Redis away, or anything unexpected: listen again shortly
                self._subscribed.clear()
                log.debug("interrupt listener: %s; listening again in %.1f s", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):  # closing a broken connection
                        pubsub.close()

    def _deliver(self, data: Any) -> None:
        text = data.decode() if isinstance(data, bytes) else str(data)
        parts = text.split(" ")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            return
        with self._lock:
            watches = list(self._watches.get(parts[0], []))
        for w in watches:
            w.heard(int(parts[1]), int(parts[2]))


class LiveStore(StoreCore):
    """Writing a streaming answer's deltas, and hearing a session's interrupts."""

    _listener: InterruptListener | None = None
    _listener_lock = threading.Lock()

    def write_deltas(self, session_id: str, version: int, deltas: list[Delta]) -> list[str]:
        """Append deltas to the session's events in one round trip (no retry through an outage: a
        delta that does not get there loses nothing); their ids, for the commit to delete. Only to
        a stream that is there: a step's own first event brought back one that was packed (while
        waiting), and a delta never makes one beside a packed value."""
        key = self.keys.events(session_id)
        entries = [
            {
                "type": kind,
                "version": str(version),
                "data": json.dumps({"text": text, "offset": offset}, ensure_ascii=False),
            }
            for kind, text, offset in deltas
        ]
        if len(entries) == 1:  # the common batch: one piece of text (a pipeline costs more CPU)
            ids = [self.client.xadd(key, entries[0], nomkstream=True)]  # type: ignore[arg-type]  # redis-py's types are too narrow
        else:
            pipe = self.client.pipeline(transaction=False)
            for entry in entries:
                pipe.xadd(key, entry, nomkstream=True)  # type: ignore[arg-type]
            ids = pipe.execute()
        return [str(i) for i in ids if i is not None]

    def watch_interrupts(self, session_id: str) -> InterruptWatch:
        """Hear the session's interrupts (`send --interrupt`) from now on, until `close`."""
        with LiveStore._listener_lock:
            if self._listener is None:
                self._listener = InterruptListener(self.client, self.keys.interrupts)
        return self._listener.watch(session_id)
