"""What `agents doctor` reads of Redis: the server's persistence and eviction settings, and the
sizes of the indexes that say whether work is flowing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import redis

from celery_agents.store.keys import STORED_STATES, Keys

#: the states `agents doctor` counts sessions in (stored states: `running` is not one)
COUNTED_STATES = STORED_STATES


@dataclass(frozen=True)
class Backlog:
    """How much work waits, at one instant (Redis time `now`)."""

    owed: int
    #: owed steps older than the owed grace
    stuck: int
    pending: int
    overdue: int
    rejected: int
    poison: int
    sessions: dict[str, int]


class Health:
    """Store methods for `agents doctor` (mixed into `Store`)."""

    client: redis.Redis
    keys: Keys

    def server_info(self) -> dict[str, Any]:
        return self.client.info()

    def durability_config(self) -> dict[str, str | None]:
        """appendonly, appendfsync and maxmemory-policy; empty where CONFIG is forbidden (managed Redis)."""
        try:
            return {
                name: self.client.config_get(name).get(name)
                for name in ("appendonly", "appendfsync", "maxmemory-policy")
            }
        except redis.RedisError:
            return {}

    def backlog(self, now: float, owed_grace: float) -> Backlog:
        """Index sizes, in one round trip."""
        k = self.keys
        pipe = self.client.pipeline(transaction=False)
        pipe.zcount(k.owed, "-inf", "+inf")
        pipe.zcount(k.owed, "-inf", int((now - owed_grace) * 1000))
        pipe.zcard(k.pending_all)
        pipe.zcount(k.deadlines, "-inf", int(now * 1000))
        pipe.exists(k.rejected)
        pipe.xlen(k.rejected)
        pipe.llen(k.poison)
        for state in COUNTED_STATES:
            pipe.zcard(k.state_index(state))
        owed, stuck, pending, overdue, has_rejected, rejected, poison, *states = pipe.execute()
        return Backlog(
            owed=int(owed),
            stuck=int(stuck),
            pending=int(pending),
            overdue=int(overdue),
            rejected=int(rejected) if has_rejected else 0,
            poison=int(poison),
            sessions={s: int(n) for s, n in zip(COUNTED_STATES, states, strict=True)},
        )

    def recent_rejections(self, count: int = 5) -> list[dict[str, str]]:
        """The newest entries of `completions:rejected`, newest first."""
        entries = cast("list[tuple[str, dict[str, str]]]", self.client.xrevrange(self.keys.rejected, count=count))
        return [{"id": eid, **fields} for eid, fields in entries]
