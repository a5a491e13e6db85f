"""Read-only views for people and tools: pending calls across sessions, live state, events."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

from celery_agents.model import PendingCall, SessionHeader
from celery_agents.store.codec import StreamEntries, event_from_entry, merge_outcome, pending_view, unfinished_rows
from celery_agents.store.core import StoreCore
from celery_agents.store.records import Live


class ViewStore(StoreCore):
    """Read-only views across sessions: pending calls, live state, the event stream."""

    def live_state(self, headers: list[SessionHeader]) -> list[Live]:
        """For each session: its unfinished calls, whether a step holds its lease, and its child
        sessions; two pipelined round trips for any number of sessions."""
        k = self.keys
        pipe = self.client.pipeline(transaction=False)
        for h in headers:
            pipe.exists(k.lease(h.session_id))
            pipe.smembers(k.pending(h.session_id))
            pipe.smembers(k.children(h.session_id))
        first = pipe.execute()
        leased = [bool(x) for x in first[0::3]]
        fields = [sorted(x) for x in first[1::3]]
        children = [sorted(x) for x in first[2::3]]
        pipe = self.client.pipeline(transaction=False)
        for h, fs in zip(headers, fields, strict=True):
            if fs:
                pipe.hmget(k.calls(h.session_id), fs)
                pipe.hmget(k.results(h.session_id), fs)
                pipe.mget([k.call_started(h.session_id, f) for f in fs])
        second = iter(pipe.execute())
        out: list[Live] = []
        for h, fs, lease, kids in zip(headers, fields, leased, children, strict=True):
            pending: list[PendingCall] = []
            if fs:
                rows = unfinished_rows(next(second), next(second), next(second))
                pending = [pending_view(h.session_id, c, started) for c, started in rows]
            out.append(Live(pending, lease, kids))
        return out

    def pending_view(self, session_id: str | None = None, limit: int = 1000) -> list[PendingCall]:
        """Unfinished calls of one session, or of all sessions oldest first (never a scan)."""
        if session_id is not None:
            return [pending_view(session_id, c, started) for c, started in self._pending_rows(session_id)]
        members = cast("list[str]", self.client.zrange(self.keys.pending_all, 0, limit - 1))
        pairs = [m.split(" ", 1) for m in members]
        if not pairs:
            return []
        pipe = self.client.pipeline(transaction=False)
        for sid, field in pairs:
            pipe.hget(self.keys.calls(sid), field)
            pipe.hget(self.keys.results(sid), field)
        pipe.mget([self.keys.call_started(sid, field) for sid, field in pairs])
        raw = pipe.execute()
        started = raw.pop()
        out: list[tuple[int, int, PendingCall]] = []
        for i, (sid, _field) in enumerate(pairs):
            if raw[2 * i]:
                call = merge_outcome(raw[2 * i], raw[2 * i + 1])
                if not call.state.final:
                    out.append((call.batch, call.position, pending_view(sid, call, started[i] is not None)))
        # Calls made by one step share a creation time: keep them in the model's call order.
        out.sort(key=lambda row: (row[2].created_at, row[2].session_id, row[0], row[1]))
        return [row[2] for row in out]

    def last_event_id(self, session_id: str) -> str:
        last = cast("StreamEntries", self.client.xrevrange(self.keys.events(session_id), count=1))
        return last[0][0] if last else "0-0"

    def read_events(
        self, session_id: str, after: str = "0-0", block_ms: int | None = None, count: int = 500
    ) -> list[dict[str, Any]]:
        key = self.keys.events(session_id)
        raw: StreamEntries
        if block_ms is None:
            raw = cast(
                "StreamEntries", self.client.xrange(key, min=f"({after}" if after != "0-0" else "-", count=count)
            )
        else:
            # RESP2: [[stream, entries]] for the one stream asked, or nothing once the block ran out.
            res = cast("list[tuple[str, StreamEntries]]", self.client.xread({key: after}, block=block_ms, count=count))
            raw = res[0][1] if res else []
        return [event_from_entry(eid, fields) for eid, fields in raw]

    def follow_events(self, session_id: str, after: str = "0-0", block_ms: int = 1000) -> Iterator[dict[str, Any]]:
        while True:
            events = self.read_events(session_id, after, block_ms=block_ms)
            for e in events:
                after = e["id"]
                yield e
