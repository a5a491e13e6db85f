"""A session's versions, and new sessions made from one of them: `history`, `fork`, reruns.

Every script that makes a version (create, commit, fail, cancel, fork) records what the session
was at it in `keys.versions`: the turn count, head, state and a one-line summary. The turns are
append-only, so the transcript at a version is the prefix of that many turns. A fork copies that
prefix (turns are small and a fork must outlive its origin's deletion and retention, and live in
its own Cluster slot: a reference into the origin's list would give up all three), the newest
batch's calls when the version's head is `PartialUserTurn` (older batches are folded into the
turns already), and records its own version 1 (`forked`; none of the origin's version entries);
nothing mutable is shared. Unfinished calls copied start over in the fork: deferred ones under
new tokens of the fork (the origin's tokens stay the origin's), dispatched ones run again for the
fork, sub-agent calls with a fresh child of the fork's; a call the origin has the outcome of keeps
it (a child that answered is not asked again).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from celery_agents.errors import InvalidInput, UnknownSession
from celery_agents.model import (
    AgentSpec,
    CallMeta,
    CallState,
    LlmTurn,
    SessionHeader,
    State,
    Status,
    TrackedCall,
    UserTurn,
    VersionEntry,
    child_session_id,
)
from celery_agents.store.codec import STORED_TURN, merge_outcome, turn_digest
from celery_agents.store.commit import token_record
from celery_agents.store.core import StoreCore
from celery_agents.store.header import header_to_stored
from celery_agents.store.ids import check_session_id, new_token
from celery_agents.store.signing import sign_spec


@dataclass(frozen=True)
class OriginAt:
    """What a session was at one of its versions, read in one transaction."""

    header: SessionHeader
    entry: VersionEntry
    turn_jsons: list[str]
    turns: list[UserTurn | LlmTurn]
    #: every tracked call of the origin, with its outcome as recorded now
    calls: list[TrackedCall]

    @property
    def batch(self) -> list[TrackedCall]:
        """The calls of the version's newest batch, when its head says they were made."""
        if self.entry.head != "PartialUserTurn":
            return []
        index = self.entry.turns - 1
        return sorted((c for c in self.calls if c.batch == index), key=lambda c: c.position)

    def recorded_after(self) -> dict[str, TrackedCall]:
        """The completed calls the origin made from the version's newest turn on, by digest (tool
        and arguments; the first one of each)."""
        out: dict[str, TrackedCall] = {}
        for c in sorted(self.calls, key=lambda c: (c.batch, c.position)):
            if c.batch >= self.entry.turns - 1 and c.state == CallState.COMPLETED:
                out.setdefault(c.digest(), c)
        return out


@dataclass
class ForkRecord:
    """Everything `fork_session.lua` writes."""

    header: SessionHeader
    origin: str
    at: int
    turn_jsons: list[str]
    calls: list[TrackedCall]
    replay: dict[str, str] = field(default_factory=dict)

    @property
    def tokens(self) -> list[TrackedCall]:
        return [c for c in self.calls if c.state == CallState.DEFERRED and c.token]

    @property
    def dispatch(self) -> list[TrackedCall]:
        """The copied calls to hand to the workers once the fork exists."""
        return [c for c in self.calls if c.state == CallState.RUNNING]

    def to_args(self) -> str:
        body = {
            "origin": self.origin,
            "at": self.at,
            "summary": f"forked from {self.origin} at version {self.at}",
            "n_turns": len(self.turn_jsons),
            "batch": self.calls[0].batch if self.calls else -1,
            "batch_size": len(self.calls),
            "calls": [c.field for c in self.calls],
            "pending": [[c.field, int(c.created_at * 1000)] for c in self.calls if not c.state.final],
            "dispatched": [c.field for c in self.dispatch],
            "tokens": [token_record(c) for c in self.tokens],
            "replay": [[d, o] for d, o in self.replay.items()],
            "n_above": len(self.header.ancestors),
        }
        return json.dumps(body, ensure_ascii=False)


class HistoryStore(StoreCore):
    """Versions of a session, and forks of it."""

    def history(self, session_id: str) -> list[VersionEntry]:
        """Every version the session recorded, oldest first."""
        check_session_id(session_id)
        raw = cast("dict[str, str]", self.client.hgetall(self.keys.versions(session_id)))
        if not raw and not self.client.exists(self.keys.meta(session_id)):
            raise UnknownSession(f"unknown session {session_id!r}", session_id=session_id)
        entries = (_entry(v, text, raw.get(f"{v}s")) for v, text in raw.items() if v.isdigit())
        return sorted(entries, key=lambda e: e.version)

    def origin_at(self, session_id: str, version: int | None = None) -> OriginAt:
        """The session at `version` (default: its latest), read consistently: its header, turns
        and calls in one transaction (one slot), retried if a step committed in between."""
        k = self.keys
        for _ in range(5):
            header = self.header(session_id)
            versions = self.history(session_id)
            at = header.version if version is None else version
            entry = next((e for e in versions if e.version == at), None)
            if entry is None:
                known = f"{versions[0].version}..{versions[-1].version}" if versions else "none recorded"
                raise InvalidInput(f"session {session_id} has no version {at} to fork at (its versions: {known})")
            pipe = self.client.pipeline(transaction=True)
            pipe.hget(k.meta(session_id), "version")
            pipe.lrange(k.turns(session_id), 0, entry.turns - 1)
            pipe.hgetall(k.calls(session_id))
            pipe.hgetall(k.results(session_id))
            now_version, turn_jsons, calls, results = pipe.execute()
            if int(now_version) != header.version:
                continue
            merged = [merge_outcome(raw, results.get(f)) for f, raw in calls.items()]
            return OriginAt(
                header=header,
                entry=entry,
                turn_jsons=list(turn_jsons),
                turns=[STORED_TURN.validate_json(t) for t in turn_jsons],
                calls=merged,
            )
        raise InvalidInput(f"session {session_id} keeps changing; try again")

    def fork_session(
        self,
        origin: OriginAt,
        agent: AgentSpec | None = None,
        *,
        replay: bool = False,
        rebind: Rebind | None = None,
        now: float | None = None,
    ) -> ForkRecord:
        """Store a new session that is `origin` (`origin_at`) at its version, bound to `agent`
        (default: the origin's); `replay`: its calls reuse the outcomes the origin recorded after
        that version (a rerun); `rebind`: how an unfinished copied call is tracked under `agent`
        (another agent's policy decides it). Returns what was written; its `dispatch` is for the
        workers."""
        stamp = time.time() if now is None else now
        spec = agent or self.agent(origin.header.agent_hash, origin.header.session_id)
        sid = self.keys.new_session_id(beside=origin.header.session_id)
        calls = [_forked_call(c, sid, stamp) for c in origin.batch]
        if rebind is not None:
            calls = [c if c.state.final else rebind(spec, sid, c, stamp, new_token(sid)) for c in calls]
        header = _fork_header(origin, spec, sid, calls, stamp, replay)
        record = ForkRecord(
            header=header,
            origin=origin.header.session_id,
            at=origin.entry.version,
            turn_jsons=origin.turn_jsons,
            calls=calls,
            replay={d: _reused_outcome(c, origin.header.session_id) for d, c in origin.recorded_after().items()}
            if replay
            else {},
        )
        spec_json, content_hash = spec.to_json(), spec.content_hash()
        k = self.keys.for_session(sid)
        res = self._run(
            "fork_session",
            sid,
            [
                json.dumps(header_to_stored(header)),
                spec_json,
                sign_spec(self.settings.spec_key, spec_json) if self.settings.spec_key else "",
                record.to_args(),
                *record.turn_jsons,
                *(c.stored_json() for c in calls),
            ],
            extra_keys=(
                k.agent(content_hash),
                k.ids,
                k.agent_signature(content_hash),
                k.expiring,
                *(k.token(sid, (c.token or "").partition(".")[2]) for c in record.tokens),
                *(k.meta(a) for a in header.ancestors),  # the copied calls it runs again are spent there too
            ),
        )
        if res[0] != "ok":
            raise InvalidInput(f"session {sid} already exists")
        self._agents[content_hash] = spec
        return record

    def replayed(self, session_id: str) -> dict[str, str]:
        """A rerun's reuse table: call digest -> the origin's recorded outcome (JSON)."""
        return cast("dict[str, str]", self.client.hgetall(self.keys.replay(session_id)))


#: (the fork's agent, the fork's id, an unfinished copied call, now, a new token) -> the call as tracked
Rebind = Callable[[AgentSpec, str, TrackedCall, float, str], TrackedCall]


def _entry(version: str, text: str, summary: str | None) -> VersionEntry:
    """A version's entry as `_lib.lua` `record_version` writes it: field `<v>` the array `[turns,
    head, state, kind, at]`, field `<v>s` its summary (each within 64 bytes: the hash stays a
    listpack)."""
    turns, head, state, kind, at = json.loads(text)
    return VersionEntry(
        version=int(version),
        turns=int(turns),
        head=head or None,
        state=str(state),
        kind=str(kind),
        at=float(at or 0.0),
        summary=summary or "",
    )


def _forked_call(call: TrackedCall, fork_id: str, now: float) -> TrackedCall:
    """A call of the origin's newest batch as the fork takes it. Final (but for a cancellation,
    which was the origin's, not the call's), it keeps its outcome and no token. Unfinished, it
    starts over for the fork: deferred under a new token with a whole wait again (a gate asks
    again: an approval was given to the origin), dispatched again, a sub-agent call with a child
    of the fork's."""
    if call.state.final and call.state != CallState.CANCELLED:
        return call.model_copy(update={"token": None})
    meta = call.meta
    if meta.child is not None:
        meta = meta | CallMeta(child=child_session_id(fork_id, call.field))
    fresh: dict[str, Any] = {
        "result": None,
        "error": None,
        "attempts": 0,
        "started_at": None,
        "finished_at": None,
        "duration_ms": None,
        "exit_status": None,
        "completed_by": None,
        "token": None,
        "expires_at": None,
        "created_at": now,
        "meta": meta,
    }
    if call.disposition == "defer":
        wait = (call.expires_at - call.created_at) if call.expires_at else 86400.0
        fresh.update(state=CallState.DEFERRED, token=new_token(fork_id), expires_at=now + max(wait, 1.0))
    else:
        fresh.update(state=CallState.RUNNING)
    return call.model_copy(update=fresh)


def _fork_header(
    origin: OriginAt, spec: AgentSpec, sid: str, calls: list[TrackedCall], now: float, replay: bool
) -> SessionHeader:
    """The fork's header: the origin's transcript at the version, in the state its head implies;
    steps and usage count the fork's own; approvals for the session (grants) stay the origin's.
    The fork has its agent file's budget, counting what it spends from the fork on (a grant of
    the origin's is the origin's), and a fork of a sub-agent's session spends under the budgets
    above its origin, as its origin does (a fork's id is beside its origin's: one slot)."""
    head = origin.entry.head or "UserTurn"
    last = origin.turns[-1] if origin.turns else None
    status, response = Status.ACTIVE, None
    if head == "PartialUserTurn":
        state = State.WAITING if any(not c.state.final for c in calls) else State.READY
    elif head == "LlmTurn" and isinstance(last, LlmTurn) and not last.tool_calls:
        state, status, response = State.COMPLETED, Status.COMPLETED, last.text
    elif head == "LlmTurn":
        state = State.TOOLS
    else:
        state = State.READY
    return SessionHeader(
        session_id=sid,
        agent_slug=spec.slug,
        agent_hash=spec.content_hash(),
        execution_mode=spec.mode,
        version=1,
        status=status,
        state=state,
        head=head,
        created_at=now,
        updated_at=now,
        step_limit=spec.max_steps,
        turn_count=len(origin.turn_jsons),
        turns_digest=turn_digest("", origin.turn_jsons),
        response=response,
        replays=replay,
        forked_from=origin.header.session_id,
        forked_at=origin.entry.version,
        budget=spec.budget,
        ancestors=list(origin.header.ancestors),
        bounded_by=list(origin.header.bounded_by),
    )


def _reused_outcome(call: TrackedCall, origin: str) -> str:
    """The outcome a rerun's call with the same tool and arguments takes instead of running, as
    a tool port returns one (runtime/ports.py `outcome_from_json` reads it)."""
    meta = call.meta.without("media", "child") | CallMeta(reused_from=f"{origin}:{call.field}")
    body = {
        "state": "completed",
        "result": call.result,
        "duration_ms": call.duration_ms,
        "exit_status": call.exit_status,
        "attempts": 0,
        "media": call.meta.media or [],
        "meta": meta.stored(),
    }
    return json.dumps(body, ensure_ascii=False, default=str)
