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
is sent again (`MasterMoved`), to the master they name. When a sentinel holds the master down
(the quorum's `o_down`) or a failover under way, the write is sent again every `SETTLE_S` for up
to `SETTLE_FOR_S` (then it stands): the server that took it may be the one being replaced.

When fewer replicas answer within `TIMEOUT_MS` (replicas down or far behind), the write stands
(the primary has it); that is logged, and for `REST_S` writes do not wait, so a deployment whose
replicas are gone goes on at full speed, as Redis itself does unless `min-replicas-to-write` says
otherwise. What a failover then loses is what asynchronous replication loses: a worker that had
read it finds the session rewound (`agents doctor`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import redis

log = logging.getLogger("celery_agents.store")

T = TypeVar("T")

#: how long a write waits for its replicas (ms): they answer within a round trip when in sync
TIMEOUT_MS = 1000
#: after a wait that fell short, writes do not wait for this long (s)
REST_S = 5.0


#: what the sentinels say of the server that took a write no replica acknowledged
#: (store/connection.py `sentinel_verdict`): the master, replaced by another, or a failover under way
MASTER, REPLACED, UNSETTLED = "master", "replaced", "unsettled"
#: how long a write waits before it is sent again while a failover is under way (s)
SETTLE_S = 0.25
#: for how long a write no replica acknowledged is sent again while a failover is under way (s);
#: then it stands
SETTLE_FOR_S = 10.0
#: how many times a write is sent again after the server that took it turned out replaced
MOVES = 3
#: sessions remembered as written with no replica's acknowledgement, per process
UNCONFIRMED_LIMIT = 10_000


class MasterMoved(redis.ConnectionError):
    """A write no replica acknowledged went to a server the sentinels no longer name master (it
    is sent again, to the one they name: on the old one it is lost when that becomes a replica),
    or to a master they see down or being replaced (`unsettled`: sent again after `SETTLE_S`)."""

    def __init__(self, message: str, unsettled: bool = False) -> None:
        super().__init__(message)
        self.unsettled = unsettled


class ReplicaAcks:
    """How many replicas a write waits for, and whether they answered of late."""

    def __init__(
        self,
        replicas: int,
        timeout_ms: int = TIMEOUT_MS,
        rest_s: float = REST_S,
        sentinels: Callable[[tuple[Any, Any]], str] | None = None,
    ) -> None:
        """`sentinels(address)`: what they say of the server at `address` (`MASTER`,
        `REPLACED`, `UNSETTLED`; on Sentinel, store/connection.py `sentinel_verdict`); None:
        never asked."""
        self.replicas = replicas
        self.sentinels = sentinels
        self.timeout_ms = timeout_ms
        self.rest_s = rest_s
        self._lock = threading.Lock()
        #: monotonic time until which writes do not wait (replicas fell short)
        self._resting_until = 0.0
        #: writes whose replicas fell short, since this process began (what a failover may lose)
        self.short = 0
        #: writes sent again because the server that took them was no longer the master, or
        #: while a failover was under way
        self.moved = 0
        #: until when a write held back by a failover under way is not logged again (monotonic)
        self._told_until = 0.0
        #: this thread's last write: whether replicas acknowledged it (None: not a waited write)
        self._local = threading.local()
        self._order = itertools.count(1)
        #: sessions written while no replica acknowledged, with the place of that write (`begin`)
        self._unconfirmed: OrderedDict[str, int] = OrderedDict()
        #: unconfirmed sessions forgotten past `UNCONFIRMED_LIMIT` (not checked after a failover)
        self.forgotten = 0

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

    def answered(self, replicas: object, served_by: tuple[Any, Any] | None = None, settle: bool = True) -> bool:
        """WAIT's reply: whether enough replicas hold the write; if not, log it and rest. Raises
        `MasterMoved` when the server that took it (`served_by`, its address) is no longer the
        master, or (with `settle`) a failover is under way: the caller sends the write again."""
        got = int(replicas) if isinstance(replicas, int | str) else 0
        self._local.acknowledged = got >= self.replicas
        if got >= self.replicas:
            return True
        verdict = MASTER if self.sentinels is None or served_by is None else self.sentinels(served_by)
        if verdict == REPLACED or (verdict == UNSETTLED and settle):
            with self._lock:
                self.moved += 1
                # Sent again every SETTLE_S by every waiting thread: said once in a while.
                quiet = verdict == UNSETTLED and time.monotonic() < self._told_until
                if verdict == UNSETTLED and not quiet:
                    self._told_until = time.monotonic() + self.rest_s
            where = f"{served_by[0]}:{served_by[1]}" if served_by else "?"
            why = "no longer the master" if verdict == REPLACED else "a master a failover may replace"
            if quiet:
                raise MasterMoved(f"{where} is {why}", unsettled=True)
            log.warning(
                "%s of %s replica(s) acknowledged a write on %s, %s: the write goes again%s",
                got,
                self.replicas,
                where,
                why,
                " to the master the sentinels name" if verdict == REPLACED else f" in {SETTLE_S:g} s",
            )
            raise MasterMoved(f"{where} is {why}", unsettled=verdict == UNSETTLED)
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

    def unwaited(self) -> None:
        """This thread's write went without waiting (writes rest): no replica acknowledged it."""
        self._local.acknowledged = False

    def begin(self) -> int:
        """Before a write to a session: its place among this process's writes (`settle`)."""
        self._local.acknowledged = None
        return next(self._order)

    def settle(self, session_id: str, place: int) -> list[str]:
        """After that write: remember its session when no replica acknowledged it; when one did,
        hand back the sessions written unacknowledged before it (replicas hold those writes now,
        or the master changed and they may be lost: the store checks them). A WAIT answered on
        a server holds every write that server took before it."""
        acknowledged = getattr(self._local, "acknowledged", None)
        if acknowledged is None or (acknowledged and not self._unconfirmed):
            return []
        with self._lock:
            if not acknowledged:
                self._unconfirmed[session_id] = place
                self._unconfirmed.move_to_end(session_id)
                while len(self._unconfirmed) > UNCONFIRMED_LIMIT:
                    self._unconfirmed.popitem(last=False)
                    self.forgotten += 1
                return []
            due = [sid for sid, at in self._unconfirmed.items() if at < place]
            for sid in due:
                del self._unconfirmed[sid]
            return due

    def acknowledged(self, write: Callable[[], tuple[T, object, tuple[Any, Any] | None]]) -> T:
        """`write()`'s reply: it sends a write and its WAIT and returns the write's reply, WAIT's
        reply and the address of the server that took them. Sent again to the master the
        sentinels name when they replaced that server (at most `MOVES` times, then `MasterMoved`),
        and every `SETTLE_S` while a failover is under way (for up to `SETTLE_FOR_S`, then it
        stands). A writing script answers a repeat of the same request with its first reply."""
        moves = 0
        settle_until: float | None = None
        while True:
            reply, replicas, served_by = write()
            now = time.monotonic()
            try:
                self.answered(replicas, served_by, settle=settle_until is None or now < settle_until)
                return reply
            except MasterMoved as moved:
                if not moved.unsettled:
                    moves += 1
                    if moves >= MOVES:
                        raise
                    continue
                settle_until = now + SETTLE_FOR_S if settle_until is None else settle_until
                time.sleep(SETTLE_S)
