"""What `agents doctor` reads of Redis: the server's persistence and eviction settings, the
sizes of the indexes that say whether work is flowing, the deferred calls waiting for a person
(nearest deadlines first), and the sessions Redis rewound (with the operator's acknowledgement of
them)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, cast

import redis

from celery_agents.model import PendingCall, TrackedCall
from celery_agents.store.codec import pending_view
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


@dataclass(frozen=True)
class Waiting:
    """Deferred calls waiting for a person: a decision (approval gates) or a result."""

    #: every deferred call waiting (each has a deadline)
    deferred: int
    #: how many of the nearest deadlines were read: the counts below are of those (lower bounds
    #: when `deferred` is more)
    read: int
    #: approval gates among them
    gates: int
    #: those whose `call_expiring` is out or due: a tenth of their wait (at most an hour) remains
    expiring: int
    #: the nearest few, as `pending` lists them, each with whether it is expiring
    nearest: list[tuple[PendingCall, bool]]


@dataclass(frozen=True)
class Rewound:
    """Sessions a worker found older than it had read them (Redis lost writes it acknowledged)."""

    count: int
    #: those no operator acknowledged yet (`agents doctor --ack-rewound`)
    unacknowledged: int
    #: up to `limit` of them, the unacknowledged first, newest first: session id -> what the
    #: worker saw (versions and turn counts, `at`), with `acknowledged_at` once acknowledged
    sessions: dict[str, dict[str, Any]]


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
        pipe = self.client.pipeline(transaction=False)
        pipe.llen(self.keys.poison)
        for k in self.keys.all_shards():
            pipe.zcount(k.owed, "-inf", "+inf")
            pipe.zcount(k.owed, "-inf", int((now - owed_grace) * 1000))
            pipe.zcard(k.pending_all)
            pipe.zcount(k.deadlines, "-inf", int(now * 1000))
            pipe.exists(k.rejected)
            pipe.xlen(k.rejected)
            for state in COUNTED_STATES:
                pipe.zcard(k.state_index(state))
        poison, *replies = pipe.execute()
        width = 6 + len(COUNTED_STATES)
        per = [replies[i : i + width] for i in range(0, len(replies), width)]
        return Backlog(
            owed=sum(int(r[0]) for r in per),
            stuck=sum(int(r[1]) for r in per),
            pending=sum(int(r[2]) for r in per),
            overdue=sum(int(r[3]) for r in per),
            rejected=sum(int(r[5]) for r in per if r[4]),
            poison=int(poison),
            sessions={s: sum(int(r[6 + i]) for r in per) for i, s in enumerate(COUNTED_STATES)},
        )

    def waiting(self, now: float, nearest: int = 5, read: int = 500) -> Waiting:
        """The deferred calls of the `read` nearest deadlines (two round trips): how many are
        gates, how many are expiring, and the `nearest` few in full."""
        k = self.keys
        pipe = self.client.pipeline(transaction=False)
        for shard in k.all_shards():
            pipe.zcard(shard.deadlines)
            pipe.zrange(shard.deadlines, 0, read - 1, withscores=True)
        replies = pipe.execute()
        deferred = sum(int(n) for n in replies[0::2])
        rows = sorted((row for chunk in replies[1::2] for row in chunk), key=lambda r: r[1])
        members = [str(m) for m, _ in rows[:read]]
        pipe = self.client.pipeline(transaction=False)
        for member in members:
            sid, _, field = member.partition(" ")
            pipe.hget(k.calls(sid), field)
            pipe.zscore(k.for_session(sid).expiring, member)
        rows = pipe.execute()
        gates = expiring = 0
        shown: list[tuple[PendingCall, bool]] = []
        for i, member in enumerate(members):
            raw, warn_at = rows[2 * i], rows[2 * i + 1]
            if raw is None:  # decided meanwhile
                continue
            # Its warning went out (the entry left the set) or is due.
            late = warn_at is None or float(warn_at) <= now * 1000
            is_gate = bool(json.loads(raw).get("then"))
            gates, expiring = gates + is_gate, expiring + late
            if len(shown) < nearest:
                sid = member.partition(" ")[0]
                view = pending_view(sid, TrackedCall.model_validate_json(raw), stream=k.for_session(sid).completions)
                shown.append((view, late))
        return Waiting(int(deferred), len(members), gates, expiring, shown)

    def recent_rejections(self, count: int = 5) -> list[dict[str, str]]:
        """The newest entries of `completions:rejected`, newest first."""
        pipe = self.client.pipeline(transaction=False)
        for shard in self.keys.all_shards():
            pipe.xrevrange(shard.rejected, count=count)
        entries = [entry for chunk in pipe.execute() for entry in chunk]
        if self.keys.shards > 1:  # newest first over every shard (ids are times, ms-seq)
            entries.sort(key=lambda e: tuple(int(x) for x in e[0].split("-")), reverse=True)
        return [{"id": eid, **fields} for eid, fields in entries[:count]]

    def rewound_sessions(self, limit: int = 20) -> Rewound:
        """What `rewound` holds (sessions are deleted from it with the session)."""
        stored: dict[str, str] = {}
        for shard in self.keys.all_shards():
            stored.update(cast("dict[str, str]", self.client.hgetall(shard.rewound)))
        records = {sid: json.loads(raw) for sid, raw in stored.items()}
        newest_new_first = sorted(
            records, key=lambda sid: ("acknowledged_at" in records[sid], -float(records[sid].get("at", 0)))
        )
        return Rewound(
            count=len(records),
            unacknowledged=sum("acknowledged_at" not in r for r in records.values()),
            sessions={sid: records[sid] for sid in newest_new_first[:limit]},
        )

    def acknowledge_rewound(self) -> list[str]:
        """Mark every rewound session recorded now as acknowledged; returns their ids. A worker
        that finds one rewound again later writes a new record, not acknowledged. Optimistic (WATCH):
        a record written meanwhile is never marked without being read."""
        marked: list[str] = []
        for shard in self.keys.all_shards():
            marked += self._acknowledge_rewound(shard.rewound)
        return sorted(marked)

    def _acknowledge_rewound(self, key: str) -> list[str]:
        with self.client.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)  # type: ignore[no-untyped-call]  # redis-py leaves it untyped
                    raw = cast("dict[str, str]", pipe.hgetall(key))
                    seconds, micros = pipe.time()
                    at = seconds + micros / 1e6
                    marked: dict[Any, Any] = {
                        sid: json.dumps({**record, "acknowledged_at": at})
                        for sid, record in ((sid, json.loads(text)) for sid, text in raw.items())
                        if "acknowledged_at" not in record
                    }
                    if not marked:
                        pipe.unwatch()
                        return []
                    pipe.multi()
                    pipe.hset(key, mapping=marked)
                    pipe.execute()
                    return sorted(marked)
                except redis.WatchError:
                    continue
