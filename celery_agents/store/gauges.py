"""What is waiting, read from the indexes in one round trip (no scan): the worker's `/metrics`
gauges. Each figure is the size or the oldest score of a sorted set or stream the scripts keep."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from celery_agents.store.keys import Keys


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


def read_backlog(client: redis.Redis, keys: Keys) -> Backlog:
    pipe = client.pipeline(transaction=False)
    pipe.time()
    pipe.zcard(keys.pending_all)
    pipe.zcard(keys.deadlines)
    pipe.zcard(keys.dispatched)
    pipe.zrange(keys.pending_all, 0, 0, withscores=True)
    pipe.zcard(keys.owed)
    pipe.xlen(keys.completions)
    pipe.xrange(keys.completions, count=1)
    (sec, usec), pending, deferred, dispatched, oldest, owed, waiting, first = pipe.execute()
    now_ms = sec * 1000 + usec / 1000
    return Backlog(
        pending_calls=int(pending),
        deferred_calls=int(deferred),
        dispatched_calls=int(dispatched),
        oldest_pending_seconds=_age(now_ms, float(oldest[0][1]) if oldest else None),
        owed_steps=int(owed),
        completions_waiting=int(waiting),
        completions_lag_seconds=_age(now_ms, _entry_ms(first)),
    )


def _entry_ms(first: list[Any]) -> float | None:
    if not first:
        return None
    entry_id = first[0][0]
    text = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    return float(text.split("-", 1)[0])


def _age(now_ms: float, then_ms: float | None) -> float:
    return 0.0 if then_ms is None else max(0.0, (now_ms - then_ms) / 1000)
