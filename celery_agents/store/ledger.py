"""The call ledger as a worker running one dispatched call sees it: the call and whether it is
still wanted, its lease, and the marker saying a worker picked it up."""

from __future__ import annotations

from dataclasses import dataclass

import redis
from redis.lock import Lock

from celery_agents.config import Settings
from celery_agents.model import TrackedCall
from celery_agents.store.keys import Keys

#: a call's "started" marker outlives any run of the call
STARTED_TTL_S = 86400


@dataclass(frozen=True)
class CallToRun:
    """A dispatched call with what decides whether it runs: still `pending`, and its session's
    `status` and agent spec (`agent_hash`)."""

    call: TrackedCall
    pending: bool
    agent_hash: str
    status: str | None


class CallLedger:
    """Store methods for running dispatched calls (mixed into `Store`)."""

    client: redis.Redis
    keys: Keys
    settings: Settings

    def call_to_run(self, session_id: str, field: str) -> CallToRun | None:
        """The call at `field` and its session's state, in one round trip; None: no such call."""
        k = self.keys
        pipe = self.client.pipeline(transaction=False)
        pipe.hget(k.calls(session_id), field)
        pipe.sismember(k.pending(session_id), field)
        pipe.hmget(k.meta(session_id), ["agent_hash", "status"])
        raw, is_pending, (agent_hash, status) = pipe.execute()
        if raw is None or agent_hash is None:
            return None
        return CallToRun(TrackedCall.model_validate_json(raw), bool(is_pending), agent_hash, status)

    def recheck_call_later(self, session_id: str, field: str, seconds: float) -> None:
        """A dispatched call whose work another session carries on (a sub-agent's child): the
        sweeper looks at it again after `seconds` (Redis time), not at every sweep."""
        sec, usec = self.client.time()
        due_ms = int((sec + usec / 1_000_000 + seconds) * 1000)
        self.client.zadd(self.keys.dispatched, {f"{session_id} {field}": due_ms}, xx=True)

    def call_lock(self, session_id: str, field: str) -> Lock:
        """The call's lease: held by the one worker running it, renewed while it runs."""
        key = self.keys.call_lease(session_id, field)
        return Lock(self.client, key, timeout=self.settings.lease_seconds, thread_local=False)

    def mark_call_started(self, session_id: str, field: str, owner: str) -> None:
        """Picked up: if the lease lapses before an outcome is recorded, this worker died."""
        self.client.set(self.keys.call_started(session_id, field), owner, ex=STARTED_TTL_S)

    def call_pending(self, session_id: str, field: str) -> bool:
        """The call is unfinished and wanted (a cancelled session empties its pending set)."""
        return bool(self.client.sismember(self.keys.pending(session_id), field))

    def call_leased(self, session_id: str, field: str) -> bool:
        """Some worker (or CLI) runs the call now."""
        return bool(self.client.exists(self.keys.call_lease(session_id, field)))
