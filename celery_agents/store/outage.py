"""Waiting out an unreachable Redis (a restart, a failover, a cut network) for a bounded time.

A worker's store sends a call again while Redis cannot be reached, for up to
`AGENTS_REDIS_OUTAGE_SECONDS` after the first failure, so a Redis restart costs a step a pause
instead of its model answer or its tools' results. Only what may be sent twice goes through it:
every writing script answers a retry of the same request with its first reply (`once`, the
header's `last_commit`), the journal's first writer wins, and reads and lease renewals change
nothing twice. Past the bound the caller gets `RedisUnavailable`; a store made with no bound (the
CLI's, the Python client's) raises it at the first failure, after redis-py's own few retries.

One kind of write is never given up by a worker: the record of what a tool did (`effect=True`: a
runSync tool's journal entry, a dispatched call's result). The tool cannot be taken back, so its
thread waits for Redis however long it stays away, and writes it as soon as it answers; giving up
would run the tool again once Redis is back.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from celery_agents.backoff import exponential_backoff
from celery_agents.errors import RedisUnavailable

log = logging.getLogger("celery_agents.store")

T = TypeVar("T")

#: what redis-py raises when it cannot reach the server (a server loading its data after a restart
#: answers BusyLoadingError, a ConnectionError); on a Cluster also CLUSTERDOWN (a primary failed and
#: no replica took over yet), TRYAGAIN (a slot's keys are being migrated) and ClusterError "TTL
#: exhausted" (redirected more than 16 times: a slot moving again and again): each passes within
#: seconds, as an outage does
UNREACHABLE: tuple[type[redis.RedisError], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ClusterError,
    redis.exceptions.TryAgainError,
)

#: the waits between tries: doubling from 50 ms up to 1 s
_FIRST_WAIT_S, _LONGEST_WAIT_S = 0.05, 1.0


class OutageWatch:
    """Retries calls through an outage of at most `seconds`, and logs each outage once when it
    begins and once when it ends, however many threads wait through it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._lock = threading.Lock()
        #: when a call of this store first failed in the current outage (monotonic), else None
        self._down_since: float | None = None

    def call(self, send: Callable[[], T], effect: bool = False) -> T:
        """`send()`, tried again while Redis is unreachable, until `seconds` have passed since its
        first failure; then `RedisUnavailable`. `effect`: the record of what a tool did, tried
        until Redis answers when this watch has a bound at all (a worker's)."""
        bound = math.inf if effect and self.seconds else self.seconds
        first: float | None = None
        tries = 0
        told = False
        while True:
            try:
                value = send()
            except UNREACHABLE as exc:
                now = time.monotonic()
                first = now if first is None else first
                waited = now - first
                if waited >= bound:
                    raise self._gave_up(waited, exc) from exc
                self._began(now, exc)
                if waited >= self.seconds and not told:
                    told = True
                    log.warning("a tool's outcome waits for Redis past AGENTS_REDIS_OUTAGE_SECONDS: never given up")
                tries += 1
                time.sleep(min(exponential_backoff(_FIRST_WAIT_S, tries, _LONGEST_WAIT_S), bound - waited))
                continue
            if first is not None:
                self._ended()
            return value

    def _gave_up(self, waited: float, exc: Exception) -> RedisUnavailable:
        if not self.seconds:
            return RedisUnavailable(f"cannot reach Redis: {exc}")
        return RedisUnavailable(
            f"cannot reach Redis: gave up after {waited:.1f} s (AGENTS_REDIS_OUTAGE_SECONDS={self.seconds:g}): {exc}"
        )

    def _began(self, now: float, exc: Exception) -> None:
        with self._lock:
            if self._down_since is not None:
                return
            self._down_since = now
        log.warning(
            "cannot reach Redis (%s): waiting up to %g s for it (AGENTS_REDIS_OUTAGE_SECONDS)", exc, self.seconds
        )

    def _ended(self) -> None:
        with self._lock:
            since, self._down_since = self._down_since, None
        if since is not None:
            log.warning("Redis is reachable again after %.1f s: what waited for it goes on", time.monotonic() - since)
