"""The completions stream as its consumer group sees it.

Entries are read as raw bytes (the client decodes every other reply): whoever can XADD may write
anything there, and an entry that is not UTF-8 must be rejectable, not a crash. Applied or
rejected entries are acknowledged and deleted, so what stays in the stream is exactly what waits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import redis
from redis.client import NEVER_DECODE

#: the consumer group workers read the stream through
COMPLETIONS_GROUP = "celery-agents"

#: (entry id, fields as written)
RawEntry = tuple[str, dict[bytes, bytes]]


class GroupMissing(Exception):
    """The stream has no consumer group (deleted with the stream): make it again."""


@dataclass(frozen=True)
class GroupState:
    """What `agents doctor` shows of the completions stream."""

    #: entries in the stream: applied ones are deleted, so these all wait
    waiting: int
    #: read by a consumer and not acknowledged (a consumer died, or is applying them now)
    pending: int
    #: entries the group has not read yet (None: unknown, Redis before 7)
    lag: int | None
    #: how long the oldest waiting entry has waited, by Redis' clock (None: nothing waits)
    oldest_s: float | None


def _raw(reply: Any) -> list[RawEntry]:
    # Entries of a reply read with NEVER_DECODE: ids are bytes too; nil entries (deleted while
    # pending, Redis 6.2) carry nothing to apply.
    out: list[RawEntry] = []
    for eid, fields in reply or []:
        if eid is not None and fields is not None:
            out.append((eid.decode("ascii") if isinstance(eid, bytes) else str(eid), fields))
    return out


class CompletionStream:
    """One consumer group on `<prefix>:completions`."""

    def __init__(self, client: redis.Redis, key: str, group: str) -> None:
        self.client, self.key, self.group = client, key, group

    def ensure_group(self) -> None:
        try:
            self.client.xgroup_create(self.key, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read_new(self, consumer: str, count: int, block_ms: int | None) -> list[RawEntry]:
        """Entries no consumer of the group has read yet, oldest first. `GroupMissing`: the stream
        (and its group with it) was deleted since the group was made."""
        args: list[Any] = ["GROUP", self.group, consumer, "COUNT", count]
        if block_ms is not None:
            args += ["BLOCK", block_ms]
        try:
            reply = self.client.execute_command(  # type: ignore[no-untyped-call]  # redis-py leaves it untyped
                "XREADGROUP", *args, "STREAMS", self.key, ">", **{NEVER_DECODE: []}
            )
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc):
                raise GroupMissing(self.key) from None
            raise
        streams = cast("list[tuple[bytes, Any]] | None", reply)
        return _raw(streams[0][1]) if streams else []

    def claim_all(self, consumer: str, count: int) -> list[RawEntry]:
        """Every entry read by any consumer of the group and not acknowledged, taken over by
        `consumer`, oldest first."""
        out: list[RawEntry] = []
        cursor: Any = "0-0"
        while True:
            reply = self.client.execute_command(  # type: ignore[no-untyped-call]
                "XAUTOCLAIM", self.key, self.group, consumer, 0, cursor, "COUNT", count, **{NEVER_DECODE: []}
            )
            cursor = reply[0]
            out.extend(_raw(reply[1]))
            if cursor in (b"0-0", "0-0"):
                return out

    def ack(self, entry_id: str) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.xack(self.key, self.group, entry_id)
        pipe.xdel(self.key, entry_id)
        pipe.execute()

    def state(self) -> GroupState:
        pipe = self.client.pipeline(transaction=False)
        pipe.time()
        pipe.xlen(self.key)
        # Raw: the oldest entry may be one no one can decode.
        pipe.execute_command(  # type: ignore[no-untyped-call]
            "XRANGE", self.key, "-", "+", "COUNT", 1, **{NEVER_DECODE: []}
        )
        pipe.exists(self.key)
        now, waiting, first, exists = pipe.execute()
        groups: list[dict[str, Any]] = self.client.xinfo_groups(self.key) if exists else []
        group = next((g for g in groups if g.get("name") == self.group), None)
        pending = int(group["pending"]) if group else 0
        lag = group.get("lag") if group else waiting
        oldest = None
        if first:
            now_ms = int(now[0]) * 1000 + int(now[1]) // 1000
            oldest = max(0.0, (now_ms - int(first[0][0].split(b"-")[0])) / 1000)
        return GroupState(waiting=int(waiting), pending=pending, lag=None if lag is None else int(lag), oldest_s=oldest)
