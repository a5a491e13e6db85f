"""What the sweeper and `agents doctor` read of the outbox (`owed`) and of dispatched calls
(`dispatched`): the entries older than a cutoff, and what is known of each (`scheduler.recovery`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from celery_agents.model import TrackedCall
from celery_agents.model.recovery import Entry
from celery_agents.store.core import UNREACHED
from celery_agents.store.keys import Keys


@dataclass(frozen=True)
class DueCall:
    """A dispatched call older than the cutoff: its disposition says which queue it waits in
    (None: the call is gone)."""

    session_id: str
    field: str
    committed_ms: float
    disposition: str | None


class RecoveryReads:
    """Store methods for recovering lost work (mixed into `Store`)."""

    client: redis.Redis
    keys: Keys
    #: StoreCore's: a pipeline's replies, those out of reach `UNREACHED`
    in_reach: Callable[[Any], list[Any]]
    #: StoreCore's: the members of every shard's sorted set due by a time, with their scores
    due: Callable[[str, float, int], list[tuple[str, float]]]

    def anything_due(self, older_than: float) -> bool:
        """Some owed step or dispatched call is older than `older_than` (Redis time, seconds)."""
        cutoff = int(older_than * 1000)
        pipe = self.client.pipeline(transaction=False)
        for shard in self.keys.all_shards():
            pipe.zcount(shard.owed, "-inf", cutoff)
            pipe.zcount(shard.dispatched, "-inf", cutoff)
        return any(n for n in self.in_reach(pipe) if n is not UNREACHED)

    def owed_due(self, older_than: float, limit: int = 200) -> list[tuple[str, float]]:
        """Owed steps older than `older_than`: (session id, committed ms), oldest first."""
        return self.due("owed", older_than, limit)

    def dispatched_due(self, older_than: float, limit: int = 200) -> list[DueCall]:
        """Dispatched calls older than `older_than`, each with its disposition; two round trips."""
        rows = self.due("dispatched", older_than, limit)
        members = [(*_member(m), score) for m, score in rows]
        pipe = self.client.pipeline(transaction=False)
        for sid, field, _ in members:
            pipe.hget(self.keys.calls(sid), field)
        return [
            DueCall(sid, field, score, _disposition(raw))
            for (sid, field, score), raw in zip(members, self.in_reach(pipe), strict=True)
            if raw is not UNREACHED
        ]

    def due_entries(self, older_than: float, limit: int = 1000) -> list[Entry]:
        """What is known of each owed step and dispatched call older than `older_than` (their
        messages' queues aside: `lost` is False); two round trips."""
        k = self.keys
        owed = [sid for sid, _ in self.due("owed", older_than, limit)]
        members = [m for m, _ in self.due("dispatched", older_than, limit)]
        calls = [m.split(" ", 1) for m in members]
        pipe = self.client.pipeline(transaction=False)
        for sid in owed:
            pipe.hmget(k.meta(sid), ["version", "status", "owed_version", "picked"])
            pipe.exists(k.lease(sid))
        for sid, field in calls:
            pipe.hexists(k.pending(sid), field)
            pipe.exists(k.call_lease(sid, field))
            pipe.exists(k.call_started(sid, field))
        rows = iter(pipe.execute())
        entries = []
        for _ in owed:
            (version, status, owed_version, picked), leased = next(rows), next(rows)
            still_owed = version is not None and status == "active" and owed_version == version
            entries.append(Entry(owed=still_owed, leased=bool(leased), picked=picked == version))
        for _ in calls:
            pending, leased, started = next(rows), next(rows), next(rows)
            entries.append(Entry(owed=bool(pending), leased=bool(leased), picked=bool(started)))
        return entries


def _member(member: str) -> tuple[str, str]:
    """A `dispatched` member: "<session id> <field>"."""
    sid, _, field = member.partition(" ")
    return sid, field


def _disposition(raw: str | None) -> str | None:
    return TrackedCall.model_validate_json(raw).runs_as if raw else None
