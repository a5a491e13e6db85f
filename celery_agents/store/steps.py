"""A step's reads and writes: begin (lease and load), the cached transcript, the journal, commit, end and fail."""

from __future__ import annotations

import itertools
import json
import logging
import time
import uuid
from typing import Any, cast

from celery_agents.errors import UnknownSession
from celery_agents.model import ErrorInfo, LlmTurn, SessionHeader, UserQuery, UserTurn
from celery_agents.store.codec import STORED_TURN, merge_outcome, turn_digest
from celery_agents.store.commit import CommitRecord
from celery_agents.store.core import StoreCore
from celery_agents.store.header import header_from_hash
from celery_agents.store.ids import check_session_id, parse_token
from celery_agents.store.records import Begun, Committed, LeaseLost, Loaded, Transcript

log = logging.getLogger("celery_agents.store")

#: A step's journal outlives any step that could still reuse it (redelivery comes within hours).
JOURNAL_TTL_S = 86400


class StepStore(StoreCore):
    """What a step reads and writes: its lease, the session it loads, its journal and its commit."""

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
        header = header_from_hash(dict(zip(flat[::2], flat[1::2], strict=True)))
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

    def _went_back(self, session_id: str, seen: Transcript, stored: SessionHeader) -> None:
        """Redis lost writes this process had read (a replica promoted before it had them, a power
        cut with `appendfsync everysec`): log it and keep it where `agents doctor` shows it."""
        record = {
            "at": time.time(),
            "seen_version": seen.version,
            "seen_turns": len(seen.turns),
            "stored_version": stored.version,
            "stored_turns": stored.turn_count,
        }
        log.warning(
            "session %s went back: Redis holds version %s (%s turns), not what this process read at version %s "
            "(%s turns): Redis lost writes (failover, or power cut with appendfsync everysec?); the stored turns "
            "are read again and the cached ones dropped",
            session_id,
            stored.version,
            stored.turn_count,
            seen.version,
            len(seen.turns),
        )
        self.client.hset(self.keys.rewound, session_id, json.dumps(record))

    def rewound(self, limit: int = 20) -> tuple[int, dict[str, dict[str, Any]]]:
        """Sessions whose stored state went back under a worker (how many, and up to `limit`)."""
        count = int(self.client.hlen(self.keys.rewound))
        entries = itertools.islice(self.client.hscan_iter(self.keys.rewound, count=limit), limit)
        return count, {sid: json.loads(raw) for sid, raw in entries}

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
            return Begun("ok", loaded)
        return Begun(res[0], detail=str(res[1]) if len(res) > 1 else "")

    def renew_leases(self, held: list[tuple[str, str]]) -> list[bool]:
        """Extend leases (a session's step lease or a call's: `(key, owner)` pairs) in one round
        trip; each only if its owner still holds it. A process holding hundreds of leases renews
        them all in one go."""
        if not held:
            return []
        lease_ms = int(self.settings.lease_seconds * 1000)
        pipe = self.client.pipeline(transaction=False)
        for key, owner in held:
            self.scripts.run("lease_renew", [key], [owner, lease_ms], client=pipe)
        return [bool(r) for r in pipe.execute()]

    def commit(self, record: CommitRecord, now: float | None = None) -> Committed:
        """Commit a step at `record.version`, unless the session moved on or the lease was lost."""
        sid = record.session_id
        token_keys = tuple(self.keys.token(sid, parse_token(c.token)[1]) for c in record.tokens if c.token)
        # One id per call, sent again by the client's retries: commit_step answers a retry of a
        # commit it made with that commit's reply (the header's `last_commit`).
        attempt = uuid.uuid4().hex
        lease_ms = int(self.settings.lease_seconds * 1000)
        args = record.to_args(attempt, lease_ms)
        res = self._run("commit_step", sid, args, extra_keys=token_keys, now=now, request_id=attempt)
        if res[0] != "ok":
            return Committed(res[0])
        entry = self._turn_cache.get(sid)
        if entry is not None and len(entry.turns) == record.base_turn_count and entry.digest == record.base_digest:
            self._remember(sid, Transcript([*entry.turns, *record.turns], record.turns_digest, int(res[1])))
        return Committed("ok", int(res[1]), bool(res[2]))

    def end_step(self, session_id: str, owner: str, request: str, reason: str, keep_owed: bool = False) -> None:
        self._run("end_step", session_id, [owner, request, reason, "1" if keep_owed else "0"])

    def fail_step(self, session_id: str, version: int, error: ErrorInfo, owner: str) -> bool:
        res = self._run("fail_step", session_id, [version, error.model_dump_json(), owner, error.code])
        return bool(res[0] == "ok")

    def journal_put(self, session_id: str, field: str, value: str, owner: str, version: int) -> str:
        """Record work done in this step; returns the first recorded value (which wins). Raises
        `LeaseLost` when the step at `version`, run by `owner`, was taken over or overtaken."""
        k = self.keys
        res = self.scripts.run(
            "journal_put",
            [k.journal(session_id), k.lease(session_id), k.meta(session_id)],
            [field, value, owner, version, JOURNAL_TTL_S],
        )
        if res[0] != "ok":
            raise LeaseLost(f"the step of session {session_id} at version {version} lost its lease ({res[1]})")
        return str(res[1])
