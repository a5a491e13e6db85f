"""The call ledger as a worker running one dispatched call sees it: the call and whether it is
still wanted, its lease, and the marker saying a worker picked it up."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import redis
from redis.exceptions import LockError
from redis.lock import Lock

from celery_agents.config import Settings
from celery_agents.errors import BudgetExceeded, UnknownToken
from celery_agents.model import CallState, TrackedCall
from celery_agents.store.connection import translated
from celery_agents.store.ids import parse_token
from celery_agents.store.keys import Keys
from celery_agents.store.replication import MasterMoved, ReplicaAcks
from celery_agents.store.signing import seal_verifies, trusted_grants

#: a call's "started" marker outlives any run of the call
STARTED_TTL_S = 86400


@dataclass(frozen=True)
class Decided:
    """An approval of a deferred call as complete_token.lua recorded it in the call's token (the
    call's own record and its results entry say nothing a worker believes): `arguments` the person
    approved (an approval gate; None: a deferred delegation runs its call's own), what the documents
    call the decision, and who made it."""

    arguments: dict[str, Any] | None = None
    outcome: str | None = None
    by: str | None = None


@dataclass(frozen=True)
class CallToRun:
    """A dispatched call with what decides whether it runs: still `pending`, and its session's
    `status` and agent spec (`agent_hash`)."""

    call: TrackedCall
    pending: bool
    agent_hash: str
    status: str | None
    #: the approval recorded on the call's token (a gate or a deferred delegation); None: none is
    #: (a call of another disposition needs none)
    decision: Decided | None = None
    #: tools granted for the rest of the session (`approve --for-session`): name -> schema digest,
    #: only those whose seal verifies when AGENTS_SPEC_KEY is set
    grants: dict[str, str] = field(default_factory=dict)
    #: the session failed `budget_exceeded`: in the step that dispatched this call, the calls
    #: within the limit were dispatched and the session stopped after them; they run all the same
    stopped_by_budget: bool = False

    @property
    def runnable(self) -> bool:
        """Its session lets a pending call run: active, or stopped by its budget after it."""
        return self.status == "active" or (self.status == "failed" and self.stopped_by_budget)


class CallLease(Lock):
    """A call's lease (a redis-py lock that expires unless renewed)."""

    def let_go(self) -> None:
        """Release it if it is still ours: one that lapsed (another worker may hold it now) is not."""
        with contextlib.suppress(LockError):
            self.release()


class CallLedger:
    """Store methods for running dispatched calls (mixed into `Store`)."""

    client: redis.Redis
    keys: Keys
    settings: Settings
    acks: ReplicaAcks
    #: StoreCore's: sends what may be sent twice through a moment of Redis away
    through_outage: Callable[..., Any]

    def call_to_run(self, session_id: str, field: str) -> CallToRun | None:
        """The call at `field` and its session's state, in one round trip (two for a deferred call:
        its token); None: no such call."""
        k = self.keys
        pipe = self.client.pipeline(transaction=False)
        pipe.hget(k.calls(session_id), field)
        pipe.hexists(k.pending(session_id), field)
        pipe.hmget(k.meta(session_id), ["agent_hash", "status", "grants", "error_code"])
        raw, is_pending, (agent_hash, status, grants, error_code) = self.through_outage(pipe.execute)
        if raw is None or agent_hash is None:
            return None
        call = TrackedCall.model_validate_json(raw)
        decision = self.decision_of(session_id, call) if call.disposition == "defer" else None
        if decision is not None:
            call = call.model_copy(update={"state": CallState.RUNNING})
        granted = trusted_grants(self.settings.spec_key, session_id, json.loads(grants) if grants else {})
        stopped = error_code == BudgetExceeded.code
        return CallToRun(call, bool(is_pending), agent_hash, status, decision, granted, stopped_by_budget=stopped)

    def decision_of(self, session_id: str, call: TrackedCall) -> Decided | None:
        """The approval complete_token.lua recorded on the call's token: the token is this
        session's and this call's, decided `approved`, and (AGENTS_SPEC_KEY set) its seal verifies;
        else None, whatever the call's record or its results entry say."""
        try:
            sid, secret = parse_token(call.token or "")
        except UnknownToken:
            return None
        if sid != session_id:
            return None
        names = ["state", "field", "decision", "approved", "seal"]
        found = cast("list[str | None]", self.client.hmget(self.keys.token(sid, secret), names))
        state, of, decision, approved, seal = found
        if (state, of, decision) != ("completed", call.field, "approved") or approved is None:
            return None
        key = self.settings.spec_key
        if key is not None and not seal_verifies(key, seal, "decision", call.token or "", approved):
            return None
        record = json.loads(approved) if approved else {}
        if not isinstance(record, dict):
            return None
        arguments = record.get("arguments")
        return Decided(
            arguments if isinstance(arguments, dict) else None, record.get("decision"), record.get("completed_by")
        )

    def recheck_call_later(self, session_id: str, field: str, seconds: float) -> None:
        """A dispatched call whose work another session carries on (a sub-agent's child): the
        sweeper looks at it again after `seconds` (Redis time), not at every sweep."""
        sec, usec = self.client.time()
        due_ms = int((sec + usec / 1_000_000 + seconds) * 1000)
        self.client.zadd(self.keys.for_session(session_id).dispatched, {f"{session_id} {field}": due_ms}, xx=True)

    def let_go(self, lease: CallLease) -> None:
        """Release a call's lease if it is still ours, through a moment of Redis away (a lease
        left held would keep the call from being taken over until it lapsed)."""
        self.through_outage(lease.let_go)

    def call_lock(self, session_id: str, field: str) -> CallLease:
        """The call's lease: held by the one worker running it, renewed while it runs."""
        key = self.keys.call_lease(session_id, field)
        return CallLease(self.client, key, timeout=self.settings.lease_seconds, thread_local=False)

    def mark_call_started(self, session_id: str, field: str, owner: str) -> None:
        """Picked up: if the lease lapses before an outcome is recorded, this worker died. When
        writes wait for replicas, this one and the lease taken before it are on them before the
        call runs (a failover cannot hand the call to a second worker)."""
        self.through_outage(lambda: self._mark_call_started(session_id, field, owner))

    def _mark_call_started(self, session_id: str, field: str, owner: str) -> None:
        key = self.keys.call_started(session_id, field)
        if not self.acks.waiting:
            self.client.set(key, owner, ex=STARTED_TTL_S)
            return
        node_of = getattr(self.client, "node_of", None)

        def send() -> tuple[None, object, tuple[Any, Any] | None]:
            pipe = self.client.pipeline(transaction=False)
            pipe.set(key, owner, ex=STARTED_TTL_S)
            self.acks.queue(pipe, node_of(key) if node_of is not None else None)
            return None, pipe.execute()[1], getattr(pipe, "served_by", None)

        try:
            self.acks.acknowledged(send)
        except MasterMoved as moved:
            raise translated(moved) from None

    def call_pending(self, session_id: str, field: str) -> bool:
        """The call is unfinished and wanted (a cancelled session empties its pending calls)."""
        return bool(self.client.hexists(self.keys.pending(session_id), field))

    def call_leased(self, session_id: str, field: str) -> bool:
        """Some worker (or CLI) runs the call now."""
        return bool(self.client.exists(self.keys.call_lease(session_id, field)))
