"""What the workers share besides sessions: heartbeats, the sweeper's turn, the completions
stream and its consumer's lock, and the chaos tests' checkpoints."""

from __future__ import annotations

import json
from typing import Any

import redis
from redis.lock import Lock

from celery_agents.store.keys import Keys
from celery_agents.store.stream import COMPLETIONS_GROUP, CompletionStream

#: how long the completions consumer's lock lasts unless renewed (another worker takes over then)
COMPLETIONS_LOCK_S = 5.0


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

    def completions_lock(self) -> Lock:
        """Held by the one worker applying the completions stream (entries apply in stream order)."""
        return Lock(self.client, self.keys.lock("completions"), timeout=COMPLETIONS_LOCK_S, thread_local=False)

    def completion_stream(self) -> CompletionStream:
        return CompletionStream(self.client, self.keys.completions, COMPLETIONS_GROUP)

    def completions_waiting(self) -> int:
        """Entries in the completions stream (applied ones are deleted: these all wait)."""
        return int(self.client.xlen(self.keys.completions))

    def mark_checkpoint(self, name: str, session_id: str) -> None:
        """Chaos tests: this worker reached fault checkpoint `name` with `session_id` (runtime/faults.py)."""
        self.client.set(self.keys.fault(name), session_id)
