"""What is waiting, read from the indexes in one round trip (no scan): the worker's `/metrics`
gauges. Each figure is the size or the oldest score of a sorted set or stream the scripts keep;
the approval gates by time left take a second round trip, bounded: the calls of the
`GATES_READ` nearest deadlines. `QueueLists` reads the broker's queue lists on a Redis (the state
Redis, or the broker's own), which tasks/queues.py makes sense of."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import redis

from celery_agents.store.connection import client_for_url
from celery_agents.store.keys import Keys

#: the nearest deadlines whose calls a scrape reads to tell approval gates from other deferred calls
GATES_READ = 500
#: the buckets of `gates_by_left`: a gate with less than the bound left is counted in the first
#: bucket whose bound is above what is left (a deadline passed counts as none left)
GATE_BUCKETS = (("<1h", 3600.0), ("<1d", 86400.0), (">=1d", float("inf")))


@dataclass(frozen=True)
class Backlog:
    """Unfinished calls, owed steps and unapplied completions, with the age of the oldest."""

    #: every unfinished call of every session
    pending_calls: int
    #: deferred calls waiting for a completion (each has a deadline)
    deferred_calls: int
    #: runAsync/runIsolated calls published and not finished
    dispatched_calls: int
    #: seconds since the oldest unfinished call was created (0 when none)
    oldest_pending_seconds: float
    #: sessions owed a step (the outbox)
    owed_steps: int
    #: entries of the completions stream not applied yet (applied ones are deleted)
    completions_waiting: int
    #: seconds since the oldest of them was written (0 when none): the completions lag
    completions_lag_seconds: float
    #: approval gates waiting for a decision by time left (`GATE_BUCKETS`), among the
    #: `GATES_READ` nearest deadlines (past that many, the farther buckets are lower bounds)
    gates_by_left: dict[str, int] = field(default_factory=dict)


def read_backlog(client: redis.Redis, keys: Keys) -> Backlog:
    """The backlog over every index shard, in one round trip (and one more for the gates)."""
    pipe = client.pipeline(transaction=False)
    pipe.time()
    shards = keys.all_shards()
    for shard in shards:
        pipe.zcard(shard.pending_all)
        pipe.zcard(shard.deadlines)
        pipe.zcard(shard.dispatched)
        pipe.zrange(shard.pending_all, 0, 0, withscores=True)
        pipe.zcard(shard.owed)
        pipe.xlen(shard.completions)
        pipe.xrange(shard.completions, count=1)
        pipe.zrange(shard.deadlines, 0, GATES_READ - 1, withscores=True)
    replies = pipe.execute()
    sec, usec = replies[0]
    now_ms = sec * 1000 + usec / 1000
    per = [replies[1 + 8 * i : 9 + 8 * i] for i in range(len(shards))]
    oldest = [float(row[3][0][1]) for row in per if row[3]]
    firsts = [ms for ms in (_entry_ms(row[6]) for row in per) if ms is not None]
    nearest = sorted((entry for row in per for entry in row[7]), key=lambda e: float(e[1]))[:GATES_READ]
    return Backlog(
        pending_calls=sum(int(row[0]) for row in per),
        deferred_calls=sum(int(row[1]) for row in per),
        dispatched_calls=sum(int(row[2]) for row in per),
        oldest_pending_seconds=_age(now_ms, min(oldest) if oldest else None),
        owed_steps=sum(int(row[4]) for row in per),
        completions_waiting=sum(int(row[5]) for row in per),
        completions_lag_seconds=_age(now_ms, min(firsts) if firsts else None),
        gates_by_left=_gates_by_left(client, keys, nearest, now_ms),
    )


def _gates_by_left(client: redis.Redis, keys: Keys, nearest: list[Any], now_ms: float) -> dict[str, int]:
    """Of these deadlines (`<session_id> <field>` by ms), the calls that are approval gates (their
    record names a `then`), counted by time left; a call gone meanwhile is not counted."""
    counts = {name: 0 for name, _ in GATE_BUCKETS}
    if not nearest:
        return counts
    pipe = client.pipeline(transaction=False)
    for member, _ in nearest:
        sid, _, call_field = (member.decode() if isinstance(member, bytes) else str(member)).partition(" ")
        pipe.hget(keys.calls(sid), call_field)
    for raw, (_, deadline_ms) in zip(pipe.execute(), nearest, strict=True):
        if raw is None or not json.loads(raw).get("then"):
            continue
        left = max(0.0, (float(deadline_ms) - now_ms) / 1000)
        counts[next(name for name, bound in GATE_BUCKETS if left < bound)] += 1
    return counts


class QueueLists:
    """The lists of a Redis broker's queues: each one's length and oldest entry."""

    def __init__(self, client: redis.Redis, owned: bool = False) -> None:
        self._client, self._owned = client, owned

    @classmethod
    def at(cls, url: str) -> QueueLists:
        """The lists of the broker Redis at `url` (a connection of their own, closed by `close`)."""
        return cls(client_for_url(url), owned=True)

    def heads(self, keys: list[str]) -> list[tuple[int, str | None]]:
        """Each list's length and its oldest entry (the last: kombu pushes at the head), in one
        round trip."""
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.llen(key)
            pipe.lindex(key, -1)
        rows = iter(pipe.execute())
        return [(int(length), _text(oldest)) for length, oldest in zip(rows, rows, strict=True)]

    def close(self) -> None:
        if self._owned:
            self._client.close()


def _text(raw: Any) -> str | None:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else raw


def _entry_ms(first: list[Any]) -> float | None:
    if not first:
        return None
    entry_id = first[0][0]
    text = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    return float(text.split("-", 1)[0])


def _age(now_ms: float, then_ms: float | None) -> float:
    return 0.0 if then_ms is None else max(0.0, (now_ms - then_ms) / 1000)
