"""How far Redis keeps what it acknowledged, and waiting, after the writes a user cannot repair (a
session started, a message sent, a completion accepted), until its append-only file holds them.

Redis answers a write before it fsyncs it (unless `appendfsync always`), and with `everysec` even
before it writes it: while a background fsync still runs, `flushAppendOnlyFile` (aof.c; Redis
6.2, 7.0 and 8.2 all do it) leaves the AOF buffer in memory for up to 2 s and answers clients
meanwhile, so on a slow disk a crash of the Redis process itself (kill -9, the OOM killer) loses
writes it acknowledged, and every write after them. `keep()` waits until the AOF file holds
everything written before it was called, read from `INFO persistence` (`aof_current_size` has
passed what was written or buffered), usually in one round trip; with `AGENTS_ACK_FSYNC=1` on
Redis ≥ 7.2 and `everysec`, until Redis has fsynced it (`WAITAOF`, up to ~1 s more), so that a
power cut keeps it too.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Literal, cast

import redis

from celery_agents.config import Settings
from celery_agents.errors import RedisUnavailable
from celery_agents.store.keys import Keys

log = logging.getLogger("celery_agents.store")

#: what the AOF held when `keep()` returned: `fsynced` (on disk: a power cut keeps it), `written`
#: (in the file: a crash of Redis keeps it, a power cut may not), `memory` (no AOF: a restart loses
#: it), `late` (not written within `KEEP_TIMEOUT_S`: logged), `unknown` (INFO is not allowed)
Kept = Literal["fsynced", "written", "memory", "late", "unknown"]

#: Redis writes a postponed AOF buffer after 2 s whatever the fsync (aof.c); then the write itself
KEEP_TIMEOUT_S = 5.0
#: persistence settings are read again after this (CONFIG SET may change them)
PERSISTENCE_TTL_S = 30.0


@dataclass(frozen=True)
class Persistence:
    """What the state Redis does with a write it acknowledged."""

    #: appendonly (None: neither CONFIG nor INFO says)
    aof: bool | None
    #: appendfsync: always, everysec or no (None: CONFIG is not allowed)
    fsync: str | None
    #: the server has WAITAOF (Redis ≥ 7.2)
    waitaof: bool
    version: str


class Durability:
    """Store methods for what Redis keeps (mixed into `Store`)."""

    client: redis.Redis
    keys: Keys
    settings: Settings
    _persistence_read: tuple[float, Persistence] | None = None

    def persistence(self) -> Persistence:
        """The server's AOF settings (read at most every `PERSISTENCE_TTL_S`)."""
        read = self._persistence_read
        if read is not None and time.monotonic() - read[0] < PERSISTENCE_TTL_S:
            return read[1]
        info = self.client.info("server")
        aof: bool | None = None
        fsync: str | None = None
        try:
            config = cast("dict[str, str]", self.client.config_get("append*"))
            aof, fsync = config.get("appendonly") == "yes", config.get("appendfsync")
        except redis.ResponseError:  # CONFIG is not allowed (managed Redis): INFO says whether AOF is on
            with contextlib.suppress(redis.ResponseError):
                aof = bool(self.client.info("persistence").get("aof_enabled"))
        version = str(info.get("redis_version", "?"))
        found = Persistence(aof=aof, fsync=fsync, waitaof=_release(version) >= (7, 2), version=version)
        self._persistence_read = (time.monotonic(), found)
        return found

    def replicas_online(self) -> int | None:
        """How many replicas follow this primary now (`INFO replication`: online, at most 1 s
        behind); None when INFO may not be read."""
        try:
            info = self.client.info("replication")
        except redis.ResponseError:
            return None
        online = 0
        for name, value in info.items():
            if name.startswith("slave") and isinstance(value, dict):
                online += value.get("state") == "online" and int(value.get("lag", 0)) <= 1
        return online

    def keep(self) -> Kept:
        """Wait until Redis's AOF holds every write made before this call (see the module)."""
        try:
            p = self.persistence()
            if p.aof is False:
                return "memory"
            if p.fsync == "always":
                return "fsynced"  # Redis wrote and fsynced it before it answered
            if p.fsync == "no":
                return "written"  # never postponed: written before it answered, fsynced when the kernel likes
            if self.settings.ack_fsync and p.waitaof and p.fsync == "everysec":
                return self._wait_fsynced()
            return self._wait_written()
        except redis.ConnectionError as exc:  # Redis went away: what it acknowledged may be lost
            raise RedisUnavailable(f"cannot reach Redis to confirm it kept the write: {exc}") from exc
        except redis.ResponseError:  # INFO, CONFIG or WAITAOF not allowed to this user
            return "unknown"

    def _wait_written(self) -> Kept:
        """Until the AOF file has grown past what it held and buffered when the wait began: the
        buffer is written in order, so a write acknowledged before is in the file then. After a
        rewrite (a new base) the wait begins again from what the new file holds and buffers."""
        deadline = time.monotonic() + KEEP_TIMEOUT_S
        target, rewrite, pause = 0, None, 0.001
        while True:
            info = self.client.info("persistence")
            if not info.get("aof_enabled"):
                return "memory"
            size, buffered = int(info["aof_current_size"]), int(info["aof_buffer_length"])
            if buffered == 0:
                return "written"
            seen = (info.get("aof_rewrites"), info.get("aof_base_size"))
            if seen != rewrite:  # the first look, or a rewrite since the last
                target, rewrite = size + buffered, seen
            elif size >= target:
                return "written"
            if time.monotonic() > deadline:
                return self._late(f"has not written it to its append-only file after {KEEP_TIMEOUT_S:g} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _wait_fsynced(self) -> Kept:
        # WAITAOF waits for the offset of this connection's last write: a write of our own on the
        # same connection (a pipeline) stands after every write made before, whichever connection made it.
        pipe = self.client.pipeline(transaction=False)
        pipe.incr(self.keys.acks_fsynced)
        pipe.execute_command("WAITAOF", 1, 0, int(KEEP_TIMEOUT_S * 1000))  # type: ignore[no-untyped-call]
        _, (local, _replicas) = pipe.execute()
        if int(local) >= 1:
            return "fsynced"
        return self._late(f"has not fsynced it after {KEEP_TIMEOUT_S:g} s (WAITAOF)")

    def _late(self, what: str) -> Kept:
        log.warning("Redis acknowledged a write and %s (is its disk stalled?): a crash of Redis now may lose it", what)
        return "late"


def _release(version: str) -> tuple[int, ...]:
    """`7.2.4` -> (7, 2, 4); what does not parse is (0,)."""
    try:
        return tuple(int(part) for part in version.split(".")[:3])
    except ValueError:
        return (0,)
