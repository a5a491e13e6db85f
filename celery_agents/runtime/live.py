"""A step's live output: the `LiveOutput` its model call streams to, over the session's events.

Each batch the model port hands over is one pipelined write of `text_delta` / `reasoning_delta`
events (store/live.py); their ids go to the step's commit, which deletes them. A write that fails
is dropped (a delta lost loses nothing: the committed answer is the truth), and a step writes at
most `MAX_WRITES` batches. The step hears its session's interrupts from before it loaded the
session: a message queued after that load, sent with `--interrupt`, interrupts its model call.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from celery_agents.model import EventType
from celery_agents.scheduler.ports import DeltaKind
from celery_agents.store import Delta, InterruptWatch, Store

log = logging.getLogger("celery_agents.step")

#: a hook that hears each delta as the stream has it (an inline step's caller: the CLI)
DeltaHook = Callable[[dict[str, Any]], None]

#: the most batches one step writes (the rest of a very long answer is not streamed)
MAX_WRITES = 1000
#: the most characters one delta event carries, and the most a batch waits for before its
#: interval: a 500-token answer arriving at once (~2,400 characters) is one event, one `XADD`
MAX_CHARS = 8192

_TYPES: dict[DeltaKind, str] = {"text": EventType.TEXT_DELTA.value, "reasoning": EventType.REASONING_DELTA.value}


class SessionLive:
    """The live output of one step's model call (`scheduler.ports.LiveOutput`)."""

    def __init__(
        self,
        store: Store,
        session_id: str,
        version: int,
        *,
        watch: InterruptWatch | None = None,
        read: int = 0,
        hook: DeltaHook | None = None,
        watched: bool = True,
    ) -> None:
        """`read`: how many queued messages the step read (an interrupt for one of them is not one);
        `watched`: someone follows the session's events, so its answer streams (unwatched, it is
        asked for whole: a streamed answer costs more CPU, docs/performance.md)."""
        self.store, self.session_id, self.version = store, session_id, version
        self.watched = watched
        self.interval = store.settings.stream_flush_ms / 1000
        self.max_chars = MAX_CHARS
        self.hook = hook
        #: the ids of the deltas written, for the commit to delete
        self.ids: list[str] = []
        self._read = read
        self._offsets: dict[DeltaKind, int] = {"text": 0, "reasoning": 0}
        self._writes = 0
        self._interrupted = threading.Event()
        self._wakes: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        if watch is not None:
            watch.on_notice(self._heard)

    def _heard(self, version: int, queued: int) -> None:
        if version != self.version or queued <= self._read:
            return  # another version's, or a message this step read: it is in the call already
        with self._lock:
            self._interrupted.set()
            wakes = list(self._wakes)
        for wake in wakes:
            wake()

    def interrupted(self) -> bool:
        return self._interrupted.is_set()

    def on_interrupt(self, wake: Callable[[], None]) -> None:
        with self._lock:
            self._wakes.append(wake)
            now = self._interrupted.is_set()
        if now:
            wake()

    def start(self) -> None:
        self._offsets = {"text": 0, "reasoning": 0}

    def write(self, parts: list[tuple[DeltaKind, str]]) -> None:
        deltas: list[Delta] = []
        for kind, text in parts:
            for i in range(0, len(text), MAX_CHARS):
                piece = text[i : i + MAX_CHARS]
                deltas.append((_TYPES[kind], piece, self._offsets[kind]))
                self._offsets[kind] += len(piece)
        if not deltas or self._writes >= MAX_WRITES:
            return
        self._writes += 1
        ids: list[str] = []
        try:
            ids = self.store.write_deltas(self.session_id, self.version, deltas)
            self.ids += ids
        except Exception as exc:  # a delta lost loses nothing
            log.debug("session %s: live output not written: %s", self.session_id, exc)
        if self.hook is not None:
            at = time.time()
            for i, (event_type, text, offset) in enumerate(deltas):
                eid = ids[i] if i < len(ids) else ""
                self.hook(
                    {"id": eid, "type": event_type, "at": at, "version": self.version, "text": text, "offset": offset}
                )


@contextlib.contextmanager
def interrupts_heard(store: Store, session_id: str) -> Iterator[InterruptWatch | None]:
    """Hear the session's interrupts meanwhile (None where this store cannot listen)."""
    watch = None
    try:
        watch = store.watch_interrupts(session_id)
    except Exception as exc:
        log.debug("session %s: interrupts not heard: %s", session_id, exc)
    try:
        yield watch
    finally:
        if watch is not None:
            watch.close()
