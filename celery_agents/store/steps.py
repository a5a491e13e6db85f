"""A step's reads and writes: begin (lease and load), the cached transcript, the journal, commit, end and fail."""

from __future__ import annotations

import itertools
import json
import logging
import uuid
from typing import Any, cast

from celery_agents.errors import UnknownSession
from celery_agents.model import ErrorInfo, LlmTurn, SessionHeader, State, UserQuery, UserTurn
from celery_agents.model.budget import BudgetScope
from celery_agents.store.admission import HeldCall, LimitStore
from celery_agents.store.budget import BudgetStore
from celery_agents.store.codec import STORED_TURN, merge_outcome, turn_digest
from celery_agents.store.commit import CommitRecord
from celery_agents.store.counters import Counts, counts_json
from celery_agents.store.header import header_from_hash
from celery_agents.store.ids import check_session_id, parse_token
from celery_agents.store.records import Begun, Committed, LeaseLost, LeaseRef, Loaded, Released, Renewal, Transcript

log = logging.getLogger("celery_agents.store")

#: lease_renew.lua's replies
_RENEWALS: dict[int, Renewal] = {0: "lost", 1: "renewed", 2: "retaken"}

#: A step's journal outlives any step that could still reuse it (redelivery comes within hours).
JOURNAL_TTL_S = 86400


class StepStore(LimitStore, BudgetStore):
    """What a step reads and writes: its lease, the session it loads, its journal and its commit
    (with the end of its model call under the fleet's limits, `LimitStore`, and of its claims on
    the budgets above it, `BudgetStore`)."""

    def load(self, session_id: str) -> Loaded:
        """Header, all stored turns, the newest batch's calls: one round trip (turns cached)."""
        check_session_id(session_id)
        seen = self._turn_cache.get(session_id)
        res = self._run("load_session", session_id, [len(seen.turns) if seen else 0])
        if not res:
            raise UnknownSession(f"unknown session {session_id!r}", session_id=session_id)
        return self._loaded(session_id, res, seen)

    def _loaded(self, session_id: str, payload: list[Any], seen: Transcript | None) -> Loaded:
        flat, raw_turns, raw_calls, raw_results, holder, journal, inbox = payload
        header = header_from_hash(dict(zip(flat[::2], flat[1::2], strict=True)), session_id)
        turns = self._transcript(session_id, header, raw_turns, seen)
        calls = [merge_outcome(c, r) for c, r in zip(raw_calls, raw_results, strict=True) if c]
        return Loaded(
            header=header,
            turns=list(turns),
            calls=calls,
            lease_holder=holder or "",
            journal=dict(zip(journal[::2], journal[1::2], strict=True)),
            inbox=[UserQuery.model_validate_json(m) for m in inbox],
        )

    def _transcript(
        self, session_id: str, header: SessionHeader, raw_turns: list[str], seen: Transcript | None
    ) -> list[UserTurn | LlmTurn]:
        """The cached turns plus the `raw_turns` stored after them, if they are the stored
        transcript (same digest: same content, not only the same count); else every stored turn.
        `seen` is the cache entry the read was asked from: another thread of this process may
        have cached a newer one since, which says nothing about what Redis holds."""
        entry = seen
        base = entry.digest if entry is not None else ""
        cached = entry.turns if entry is not None else []
        if header.turns_digest:
            digest = turn_digest(base, raw_turns)
            valid = digest == header.turns_digest
        else:  # a session stored before digests: its count is all there is to check
            digest = ""
            valid = len(cached) + len(raw_turns) == header.turn_count
        if entry is not None and (not valid or header.version < entry.version):
            self._went_back(session_id, entry, header)
        if valid:
            turns = cached + [STORED_TURN.validate_json(t) for t in raw_turns]
        else:
            raws = cast("list[str]", self.client.lrange(self.keys.turns(session_id), 0, -1))
            turns = [STORED_TURN.validate_json(t) for t in raws]
            digest = turn_digest("", raws) if header.turns_digest else ""
        self._remember(session_id, Transcript(turns, digest, header.version))
        return list(turns)

    def _remember(self, session_id: str, transcript: Transcript) -> None:
        """Cache a session's transcript, the most recently used 512 kept (threads share the cache)."""
        with self._turn_lock:
            self._turn_cache[session_id] = transcript
            self._turn_cache.move_to_end(session_id)
            while len(self._turn_cache) > 512:
                self._turn_cache.popitem(last=False)

    def rewound(self, limit: int = 20) -> tuple[int, dict[str, dict[str, Any]]]:
        """Sessions whose stored state went back under a worker (how many, and up to `limit`)."""
        count, found = 0, dict[str, dict[str, Any]]()
        for shard in self.keys.all_shards():
            count += int(self.client.hlen(shard.rewound))
            entries = itertools.islice(self.client.hscan_iter(shard.rewound, count=limit), limit - len(found))
            found.update({sid: json.loads(raw) for sid, raw in entries})
        return count, found

    def turns(self, session_id: str) -> list[UserTurn | LlmTurn]:
        check_session_id(session_id)
        return [STORED_TURN.validate_json(t) for t in self.client.lrange(self.keys.turns(session_id), 0, -1)]

    def begin_step(self, session_id: str, version: int, owner: str, request: str = "") -> Begun:
        """Take the session's lease for a step at `version` and read what the step needs."""
        check_session_id(session_id)
        lease_ms = int(self.settings.lease_seconds * 1000)
        seen = self._turn_cache.get(session_id)
        res = self._run(
            "begin_step",
            session_id,
            [version, owner, lease_ms, request, len(seen.turns) if seen else 0],
            clock="event",
        )
        if res[0] == "ok":
            loaded = self._loaded(session_id, res[1], seen)
            loaded.redis_now = int(res[2]) / 1000
            loaded.watched = bool(int(res[3])) if len(res) > 3 else False
            return Begun("ok", loaded)
        return Begun(res[0], detail=str(res[1]) if len(res) > 1 else "")

    def renew_leases(self, held: list[LeaseRef]) -> list[Renewal]:
        """Extend leases (a session's step lease or a call's) in one round trip; each only if its
        owner still holds it, or takes it again if it lapsed and nobody took it (for a step's lease,
        only while its session is still active at the step's version). A process holding hundreds
        of leases renews them all in one go."""
        if not held:
            return []
        lease_ms = int(self.settings.lease_seconds * 1000)
        pipe = self.client.pipeline(transaction=False)
        for ref in held:
            if ref.slot:
                self.scripts.run("slot_renew", [ref.key], [ref.owner, lease_ms], client=pipe)
            elif ref.claim:
                self.scripts.run("claim_renew", [ref.key], [ref.owner, lease_ms], client=pipe)
            elif ref.header:
                self.scripts.run("lease_renew", [ref.key, ref.header], [ref.owner, lease_ms, ref.version], client=pipe)
            else:
                self.scripts.run("lease_renew", [ref.key], [ref.owner, lease_ms], client=pipe)
        return [_RENEWALS[int(r)] for r in pipe.execute()]  # a slot's or claim's 1 and 0: renewed, lost

    def commit(self, record: CommitRecord, now: float | None = None, release: HeldCall | None = None) -> Committed:
        """Commit a step at `record.version`, unless the session moved on or the lease was lost.
        `release`: the step's model call admitted under fleet limits, ended in the same round trip
        (release.lua after commit_step, one pipeline; the two touch different keys). The step's
        claims on the budgets above (`record.claim`) end in commit_step itself."""
        sid = record.session_id
        token_keys = tuple(self.keys.token(sid, parse_token(c.token)[1]) for c in record.tokens if c.token)
        if token_keys:
            token_keys = (*token_keys, self.keys.for_session(sid).expiring)  # their `call_expiring` warnings
        if not record.spend.nothing:  # the sessions above spend what this one spends
            token_keys = (*token_keys, *(self.keys.meta(a) for a in record.above))
        if record.claim is not None:
            token_keys = (*token_keys, *(self.keys.claims(a) for a in record.claim.above))
        # One id per call, sent again by the client's retries: commit_step answers a retry of a
        # commit it made with that commit's reply (the header's `last_commit`). 64 random bits tell
        # one commit of a session at a version from another; the header keeps it, so no more.
        attempt = uuid.uuid4().hex[:16]
        lease_ms = int(self.settings.lease_seconds * 1000)
        args = record.to_args(attempt, lease_ms)
        if release is None:
            res = self._run("commit_step", sid, args, extra_keys=token_keys, now=now, request_id=attempt, clock="event")
            released = None
        else:
            res, released = self._commit_and_release(sid, args, token_keys, now, attempt, release)
        if res[0] != "ok":
            return Committed(res[0], released=released)
        if record.state == State.WAITING and not int(res[2]):
            self.pack_waiting(sid)
        entry = self._turn_cache.get(sid)
        if entry is not None and len(entry.turns) == record.base_turn_count and entry.digest == record.base_digest:
            self._remember(sid, Transcript([*entry.turns, *record.turns], record.turns_digest, int(res[1])))
        return Committed("ok", int(res[1]), bool(res[2]), released=released)

    def _commit_and_release(
        self, sid: str, args: list[str], token_keys: tuple[str, ...], now: float | None, attempt: str, held: HeldCall
    ) -> tuple[list[Any], Released]:
        """commit_step and release.lua in one pipeline. Sent again through an outage, the commit
        answers with its first reply (`last_commit`) and the release gives back nothing twice (a
        slot is removed once); only a token correction may count twice, a few tokens of one minute."""
        release_keys, release_args = self.release_args(held)

        def send() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            self._run(
                "commit_step", sid, args, extra_keys=token_keys, now=now, pipe=pipe, request_id=attempt, clock="event"
            )
            self.scripts.run("release", release_keys, release_args, client=pipe)
            replies: list[Any] = pipe.execute()
            return replies

        res, reply = self.through_outage(send)
        return res, self.released(reply)

    def budget_scopes(self, header: SessionHeader) -> list[BudgetScope]:
        """The session's own limits and spend, read with it. The budgets of the sessions above it
        are checked by its claims on them (store/budget.py), in the round trip that makes them."""
        return [BudgetScope(header.session_id, header.budget, header.spent)] if header.budget else []

    def end_step(
        self,
        session_id: str,
        owner: str,
        request: str,
        reason: str,
        keep_owed: bool = False,
        outcome: str = "",
        counts: Counts | None = None,
    ) -> None:
        """End a step that commits nothing; `outcome` (waiting, noop, error) and `counts` (what the
        step counted) go to the fleet's counters."""
        owed = "1" if keep_owed else "0"
        self._run("end_step", session_id, [owner, request, reason, owed, outcome, counts_json(counts or {})])

    def throttle_step(
        self, session_id: str, owner: str, request: str, until: float, key: str, reason: str, counts: Counts
    ) -> None:
        """Put back a step whose model call may not start before `until` (seconds, Redis's clock):
        its lease released, the step owed from then, the header's `throttled_until` (throttle_step.lua)."""
        args = [owner, request, repr(until * 1000), key, reason, counts_json(counts)]
        self._run("throttle_step", session_id, args)

    def fail_step(
        self, session_id: str, version: int, error: ErrorInfo, owner: str, counts: Counts | None = None
    ) -> bool:
        args = [version, error.model_dump_json(), owner, error.code, counts_json(counts or {})]
        res = self._run("fail_step", session_id, args)
        return bool(res[0] == "ok")

    def journaled(self, session_id: str, field: str) -> str | None:
        """What the journal of the step in flight holds under `field`, read now."""
        key = self.keys.journal(session_id)
        return cast("str | None", self.through_outage(lambda: self.client.hget(key, field)))

    def journal_put(
        self, session_id: str, field: str, value: str, owner: str, version: int, effect: bool = False
    ) -> str:
        """Record work done in this step; returns the first recorded value (which wins). Raises
        `LeaseLost` when the step at `version`, run by `owner`, was taken over or overtaken.
        `effect`: what a tool did, written however long Redis stays away."""
        k = self.keys
        keys = [k.journal(session_id), k.lease(session_id), k.meta(session_id)]
        # Sent again through an outage (the first writer wins); a tool's result however long it
        # lasts: it is never dropped for want of Redis (giving up would run the tool again).
        res = self.through_outage(
            lambda: self.scripts.run("journal_put", keys, [field, value, owner, version, JOURNAL_TTL_S]), effect
        )
        if res[0] != "ok":
            raise LeaseLost(f"the step of session {session_id} at version {version} lost its lease ({res[1]})")
        return str(res[1])
