"""What the workers share besides sessions: heartbeats, the sweeper's turn, the completions
stream and its consumer's lock, and the chaos tests' checkpoints."""

from __future__ import annotations

import json
from typing import Any

import redis
from redis.exceptions import LockError
from redis.lock import Lock

from celery_agents.store.gauges import QueueLists
from celery_agents.store.keys import Keys
from celery_agents.store.stream import COMPLETIONS_GROUP, CompletionStream

#: how long the completions consumer's lock lasts unless renewed (another worker takes over then)
COMPLETIONS_LOCK_S = 5.0


class Turn:
    """A lock one worker at a time holds while it does a job (applying the completions stream),
    renewed while it does: it lapses when its holder stalls or dies, and another takes over."""

    def __init__(self, lock: Lock, holder: str) -> None:
        self._lock, self._holder, self.held = lock, holder, False

    def hold(self) -> bool:
        """Keep (extend) the turn, or take it when free; False when another worker holds it."""
        if self.held:
            try:
                self.held = bool(self._lock.reacquire())
            except LockError:  # it lapsed while this worker stalled: whoever took it goes on
                self.held = False
        else:
            self.held = bool(self._lock.acquire(blocking=False, token=self._holder))
        return self.held

    def let_go(self) -> None:
        """Give the turn up now (when held; once lapsed, it is another's or nobody's)."""
        if self.held:
            self.held = False
            self._lock.release()


class Fleet:
    """Store methods for the workers as a group (mixed into `Store`)."""

    client: redis.Redis
    keys: Keys

    def beat(self, name: str, beat: dict[str, Any]) -> None:
        """Record worker `name`'s heartbeat (`beat["at"]` is Redis's time)."""
        self.client.hset(self.keys.workers, name, json.dumps(beat))

    def forget_worker(self, name: str) -> None:
        self.client.hdel(self.keys.workers, name)

    def take_sweep_turn(self, name: str, seconds: float) -> bool:
        """One worker sweeps at a time: True when `name` sweeps now. The turn is not released: it
        lapses after `seconds` (shorter than the sweep interval), so the workers take turns."""
        turn = Lock(self.client, self.keys.lock("sweeper"), timeout=max(0.1, seconds), thread_local=False)
        return bool(turn.acquire(blocking=False, token=name))

    def completions_turn(self, holder: str) -> Turn:
        """The turn of the one worker applying the completions streams (entries apply in stream
        order): every index shard's stream, one worker at a time."""
        lock = Lock(self.client, self.keys.lock("completions"), timeout=COMPLETIONS_LOCK_S, thread_local=False)
        return Turn(lock, holder)

    def queue_lists(self) -> QueueLists:
        """The broker's queue lists when the broker is this Redis (tasks/queues.py reads them)."""
        return QueueLists(self.client)

    def completion_stream(self) -> CompletionStream:
        """Index shard 0's completions stream (the only one on a single Redis)."""
        return CompletionStream(self.client, self.keys.completions, COMPLETIONS_GROUP)

    def completion_streams(self) -> list[CompletionStream]:
        """Every index shard's completions stream, shard 0 first."""
        return [CompletionStream(self.client, k.completions, COMPLETIONS_GROUP) for k in self.keys.all_shards()]

    def completions_waiting(self) -> int:
        """Entries in the completions streams (applied ones are deleted: these all wait)."""
        pipe = self.client.pipeline(transaction=False)
        for k in self.keys.all_shards():
            pipe.xlen(k.completions)
        return sum(int(n) for n in pipe.execute())

    def redis_uptime(self) -> float | None:
        """Seconds since the Redis server started (None where INFO is not allowed)."""
        try:
            return float(self.client.info("server")["uptime_in_seconds"])
        except (redis.ResponseError, KeyError, ValueError):
            return None

    def mark_checkpoint(self, name: str, session_id: str) -> None:
        """Chaos tests: this worker reached fault checkpoint `name` with `session_id` (runtime/faults.py)."""
        self.client.set(self.keys.fault(name), session_id)
