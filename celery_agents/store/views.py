"""Read-only views for people and tools: pending calls across sessions, live state, events."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, cast

from redis.exceptions import ResponseError

from celery_agents.model import PendingCall, QueuedMessage, SessionHeader, UserQuery
from celery_agents.store.codec import (
    StreamEntries,
    event_from_entry,
    merge_outcome,
    packed_entries,
    pending_view,
    stream_id,
    unfinished_rows,
)
from celery_agents.store.core import StoreCore
from celery_agents.store.records import Live

#: the queued messages a view lists (the oldest first; at most AGENTS_MAX_QUEUED_MESSAGES wait)
QUEUED_SHOWN = 100
#: how long a watch lasts (s; `watch`), and how often a follower renews it
WATCH_S = 30
WATCH_RENEW_S = 5.0
#: the most characters of a queued message's text a view shows
QUEUED_TEXT_CHARS = 500


def queued_message(raw: str) -> QueuedMessage:
    query = UserQuery.model_validate_json(raw)
    text = query.text if len(query.text) <= QUEUED_TEXT_CHARS else query.text[: QUEUED_TEXT_CHARS - 1] + "…"
    return QueuedMessage(text=text, media=len(query.media))


class ViewStore(StoreCore):
    """Read-only views across sessions: pending calls, live state, the event stream."""

    def live_state(self, headers: list[SessionHeader]) -> list[Live]:
        """For each session: its unfinished calls, whether a step holds its lease, and its child
        sessions; two pipelined round trips for any number of sessions."""
        k = self.keys
        pipe = self.client.pipeline(transaction=False)
        for h in headers:
            pipe.exists(k.lease(h.session_id))
            pipe.hkeys(k.pending(h.session_id))
            pipe.smembers(k.children(h.session_id))
        # The queued messages of the sessions that have some (the header counts them).
        queuing = [h for h in headers if h.inbox_waiting]
        for h in queuing:
            pipe.lrange(k.inbox(h.session_id), 0, QUEUED_SHOWN - 1)
        first = pipe.execute()
        n = 3 * len(headers)
        queued = {
            h.session_id: [queued_message(raw) for raw in rows] for h, rows in zip(queuing, first[n:], strict=True)
        }
        first = first[:n]
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
                stream = k.for_session(h.session_id).completions
                pending = [pending_view(h.session_id, c, started, stream) for c, started in rows]
            out.append(Live(pending, lease, kids, queued.get(h.session_id, [])))
        return out

    def pending_view(self, session_id: str | None = None, limit: int = 1000) -> list[PendingCall]:
        """Unfinished calls of one session, or of all sessions oldest first (never a scan)."""
        if session_id is not None:
            stream = self.keys.for_session(session_id).completions
            return [pending_view(session_id, c, started, stream) for c, started in self._pending_rows(session_id)]
        pairs = [m.split(" ", 1) for m in self._pending_members(limit)]
        if not pairs:
            return []
        pipe = self.client.pipeline(transaction=False)
        for sid, field in pairs:
            pipe.hget(self.keys.calls(sid), field)
            pipe.hget(self.keys.results(sid), field)
        if self.keys.shards == 1:
            pipe.mget([self.keys.call_started(sid, field) for sid, field in pairs])
        else:  # the keys of many sessions: as many slots
            for sid, field in pairs:
                pipe.exists(self.keys.call_started(sid, field))
        raw = pipe.execute()
        started = raw.pop() if self.keys.shards == 1 else [x or None for x in raw[2 * len(pairs) :]]
        out: list[tuple[int, int, PendingCall]] = []
        for i, (sid, _field) in enumerate(pairs):
            if raw[2 * i]:
                call = merge_outcome(raw[2 * i], raw[2 * i + 1])
                if not call.state.final:
                    stream = self.keys.for_session(sid).completions
                    out.append((call.batch, call.position, pending_view(sid, call, started[i] is not None, stream)))
        # Calls made by one step share a creation time: keep them in the model's call order.
        out.sort(key=lambda row: (row[2].created_at, row[2].session_id, row[0], row[1]))
        return [row[2] for row in out]

    def _pending_members(self, limit: int) -> list[str]:
        """`<session> <field>` of the `limit` oldest unfinished calls over every index shard."""
        if self.keys.shards == 1:
            return cast("list[str]", self.client.zrange(self.keys.pending_all, 0, limit - 1))
        pipe = self.client.pipeline(transaction=False)
        for shard in self.keys.all_shards():
            pipe.zrange(shard.pending_all, 0, limit - 1, withscores=True)
        rows = sorted((row for chunk in pipe.execute() for row in chunk), key=lambda r: r[1])
        return [member for member, _ in rows[:limit]]

    def last_event_id(self, session_id: str) -> str:
        pipe = self.client.pipeline(transaction=False)
        pipe.xrevrange(self.keys.events(session_id), count=1)
        pipe.get(self.keys.packed(session_id))
        last, packed = cast("tuple[StreamEntries, str | None]", pipe.execute())
        if not last and packed:  # a waiting session's events, packed
            last = packed_entries(packed)[-1:]
        return last[0][0] if last else "0-0"

    def read_events(
        self, session_id: str, after: str = "0-0", block_ms: int | None = None, count: int = 500
    ) -> list[dict[str, Any]]:
        """The session's events after `after` (at most `count`); with `block_ms`, when there are
        none yet, the first ones to come within that time. The events of a session left waiting
        are packed into one value (`Keys.packed`), its stream gone until its next event: they are
        read from there, and a blocked read wakes when that event brings the stream back.

        A blocking read after some event (a follower's next read) blocks first, as the only
        command it sends while the stream is there: a follower that sent another first was away
        when a streamed answer's deltas came and went (its step's commit deletes them). The packed
        value is read when that block brings nothing (a follower that was behind when the session
        was packed waits out one block)."""
        key = self.keys.events(session_id)
        if block_ms is not None and after != "0-0":
            raw = self._xread(key, after, block_ms, count)
            if raw:
                return [event_from_entry(eid, fields) for eid, fields in raw]
            return self.read_events(session_id, after, None, count)
        pipe = self.client.pipeline(transaction=False)
        pipe.xrange(key, min=f"({after}" if after != "0-0" else "-", count=count)
        pipe.get(self.keys.packed(session_id))
        ranged, packed = cast("tuple[StreamEntries | Exception, str | None]", pipe.execute(raise_on_error=False))
        raw = []
        if isinstance(ranged, Exception) and not isinstance(ranged, ResponseError):
            raise ranged
        if not isinstance(ranged, Exception):  # a ResponseError: `after` is the last id there may be
            raw = ranged
        if isinstance(packed, Exception):
            raise packed
        if not raw and packed:
            since = stream_id(after)
            raw = [e for e in packed_entries(packed) if stream_id(e[0]) > since][:count]
        if not raw and block_ms is not None:
            raw = self._xread(key, after, block_ms, count)
        return [event_from_entry(eid, fields) for eid, fields in raw]

    def _xread(self, key: str, after: str, block_ms: int, count: int) -> StreamEntries:
        # RESP2: [[stream, entries]] for the one stream asked, or nothing once the block ran out.
        res = cast("list[tuple[str, StreamEntries]]", self.client.xread({key: after}, block=block_ms, count=count))
        return res[0][1] if res else []

    def watch(self, session_id: str) -> None:
        """Say that someone follows the session's events, for `WATCH_S`: its model calls stream
        their answers as `text_delta` events meanwhile (a call nobody watches is asked whole)."""
        self.scripts.run("watch", [self.keys.meta(session_id)], [WATCH_S * 1000])

    def follow_events(self, session_id: str, after: str = "0-0", block_ms: int = 1000) -> Iterator[dict[str, Any]]:
        """The session's events after `after`, then new ones as they come; while following, the
        session is watched (its model calls stream: `watch`)."""
        watched = 0.0
        while True:
            if time.monotonic() - watched > WATCH_RENEW_S:
                self.watch(session_id)
                watched = time.monotonic()
            events = self.read_events(session_id, after, block_ms=block_ms)
            for e in events:
                after = e["id"]
                yield e
