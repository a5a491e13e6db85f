"""Waiting until replicas hold a write (`AGENTS_ACK_REPLICAS`, 1 by default on Sentinel).

Redis replicates asynchronously: it answers a write before any replica has it, and a failover
promotes a replica, so the last writes the old primary answered may be missing on the new one. A
write followed by `WAIT N TIMEOUT` on the same connection (one pipeline, one round trip) is
answered once N replicas hold it and every write before it; Sentinel promotes the replica that
holds the most of the primary's stream, so the promoted one holds it. A primary that dies before
it answers leaves the client with a connection error, and the write is sent again, to the promoted
replica: every writing script answers a repeat of the same request with its first reply.

What waits: every script a store runs on its own (steps begun and committed, journal entries,
results, completions, sessions started), and the marker a worker writes before it runs a
dispatched call. Lease renewals, sweeps and counters do not: losing one repeats nothing.

A write no replica acknowledged may also have gone to a primary the sentinels have replaced: one
that froze (or was cut off) long enough for a replica to be promoted, then ran again and, until
the sentinels turn it into a replica, takes writes on the connections clients kept, with no
replica left to acknowledge them. On Sentinel the store then asks the sentinels which server is
the master; when they name another, the pool drops its connections to the old one and the write
is sent again (`MasterMoved`), to the master they name.

When fewer replicas answer within `TIMEOUT_MS` (replicas down or far behind), the write stands
(the primary has it); that is logged, and for `REST_S` writes do not wait, so a deployment whose
replicas are gone goes on at full speed, as Redis itself does unless `min-replicas-to-write` says
otherwise. What a failover then loses is what asynchronous replication loses: a worker that had
read it finds the session rewound (`agents doctor`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

log = logging.getLogger("celery_agents.store")

#: how long a write waits for its replicas (ms): they answer within a round trip when in sync
TIMEOUT_MS = 1000
#: after a wait that fell short, writes do not wait for this long (s)
REST_S = 5.0


class MasterMoved(redis.ConnectionError):
    """A write no replica acknowledged went to a server the sentinels no longer name master: it is
    sent again, to the one they name (on the old one it is lost when that becomes a replica)."""


class ReplicaAcks:
    """How many replicas a write waits for, and whether they answered of late."""

    def __init__(
        self,
        replicas: int,
        timeout_ms: int = TIMEOUT_MS,
        rest_s: float = REST_S,
        replaced: Callable[[tuple[Any, Any]], bool] | None = None,
    ) -> None:
        """`replaced(address)`: whether the server at `address` is no longer the master (on
        Sentinel, store/connection.py `replaced_master_check`); None: never asked."""
        self.replicas = replicas
        self.replaced = replaced
        self.timeout_ms = timeout_ms
        self.rest_s = rest_s
        self._lock = threading.Lock()
        #: monotonic time until which writes do not wait (replicas fell short)
        self._resting_until = 0.0
        #: writes whose replicas fell short, since this process began (what a failover may lose)
        self.short = 0
        #: writes sent again because the server that took them was no longer the master
        self.moved = 0

    @property
    def waiting(self) -> bool:
        """Writes wait for replicas now."""
        return self.replicas > 0 and time.monotonic() >= self._resting_until

    def queue(self, pipe: Any, node: Any = None) -> None:
        """Queue the WAIT that follows a write on `pipe` (the same connection); `node`: on a
        Cluster, the primary that took the write."""
        if node is None:
            pipe.execute_command("WAIT", self.replicas, self.timeout_ms)
        else:
            pipe.execute_command("WAIT", self.replicas, self.timeout_ms, target_nodes=node)

    def answered(self, replicas: object, served_by: tuple[Any, Any] | None = None) -> bool:
        """WAIT's reply: whether enough replicas hold the write; if not, log it and rest. Raises
        `MasterMoved` when the server that took it (`served_by`, its address) is no longer the
        master: the caller sends the write again."""
        got = int(replicas) if isinstance(replicas, int | str) else 0
        if got >= self.replicas:
            return True
        if self.replaced is not None and served_by is not None and self.replaced(served_by):
            with self._lock:
                self.moved += 1
            log.warning(
                "%s of %s replica(s) acknowledged a write on %s:%s, which the sentinels no longer name master: "
                "the write goes again to the master they name",
                got,
                self.replicas,
                *served_by,
            )
            raise MasterMoved(f"{served_by[0]}:{served_by[1]} is no longer the master")
        with self._lock:
            self.short += 1
            resting = time.monotonic() < self._resting_until
            self._resting_until = time.monotonic() + self.rest_s
        if not resting:
            log.warning(
                "%s of %s replica(s) acknowledged a write within %s ms (AGENTS_ACK_REPLICAS): a failover now "
                "may lose the last writes; writes go on without waiting for %g s",
                got,
                self.replicas,
                self.timeout_ms,
                self.rest_s,
            )
        return False
