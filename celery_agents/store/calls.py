"""Calls after their step: outcomes recorded, tokens completed, rejected or expired, deadlines due."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal, cast

from celery_agents.errors import TOKEN_ERRORS, UnknownToken
from celery_agents.model import CallState, CompletionOutcome, PendingCall, TrackedCall
from celery_agents.model.admission import DEFAULT_PRIORITY
from celery_agents.store.codec import merge_outcome, outcome_json, pending_view, token_message
from celery_agents.store.core import StoreCore
from celery_agents.store.counters import Counts, counter_field, counts_json
from celery_agents.store.ids import check_session_id, parse_token
from celery_agents.store.keys import Keys
from celery_agents.store.records import Finished
from celery_agents.store.signing import decision_seal, sealed_grant


@dataclass(frozen=True)
class Decision:
    """What a person decided on a deferred call (complete_token.lua ARGV[10..14]): `kind` approve,
    reject or respond; `approved` what an approval records until the call has run (JSON); `digest`
    the call the decision was made on ('' unchecked); `grant` a tool name and its schema digest
    granted for the rest of the session. `outcome` is what the documents call the decision."""

    kind: Literal["approve", "reject", "respond"]
    outcome: Literal["approved", "edited", "rejected", "responded"]
    approved: str = ""
    digest: str = ""
    grant: tuple[str, str] | None = None

    def args(self, key: str | None, token: str) -> list[str]:
        """complete_token.lua's ARGV[10..14], a grant sealed with `key` (AGENTS_SPEC_KEY) for the
        session of `token`."""
        kind = "" if self.kind == "respond" else self.kind
        grant = ("", "")
        if self.grant is not None:
            tool, digest = self.grant
            grant = (tool, sealed_grant(key, token.partition(".")[0], tool, digest))
        return [kind, self.approved, self.digest, *grant]


NO_DECISION_ARGS = ["", "", "", "", ""]


def _decided(decision: Decision | None) -> Literal["approved", "edited", "rejected", "responded"]:
    """The decision a completion made: the one asked for, else a response (the person supplied
    the call's result: a gate's tool, or a delegation's child, never runs)."""
    return "responded" if decision is None else decision.outcome


class CallStore(StoreCore):
    """Recording the outcomes of calls and completing or expiring their tokens."""

    def calls(self, session_id: str) -> list[TrackedCall]:
        """Every tracked call of the session, oldest batch first, in call order."""
        check_session_id(session_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(self.keys.calls(session_id))
        pipe.hgetall(self.keys.results(session_id))
        raw_calls, raw_results = pipe.execute()
        calls = [merge_outcome(v, raw_results.get(k)) for k, v in raw_calls.items()]
        return sorted(calls, key=lambda c: (c.batch, c.position))

    def call(self, session_id: str, field: str) -> TrackedCall:
        """One tracked call as its step created it (without its outcome)."""
        raw = self.client.hget(self.keys.calls(session_id), field)
        if raw is None:
            raise UnknownToken(f"session {session_id!r} has no call {field}")
        return TrackedCall.model_validate_json(raw)

    def token_call(self, token: str, entry: str = "") -> tuple[TrackedCall, str]:
        """The call a token of a pending deferred call waits on, and its session's agent hash;
        `UnknownToken` when there is none (decided, expired and cancelled tokens answer theirs; one
        decided by the completions stream entry `entry` itself says so with `same_entry`)."""
        sid, secret = self._token_parts(token)
        state, field, by_entry = cast(
            "list[str | None]", self.client.hmget(self.keys.token(sid, secret), ["state", "field", "entry"])
        )
        if state is None or field is None:
            raise UnknownToken(token_message("unknown", token), token=token)
        if state != "pending":
            err = TOKEN_ERRORS.get(state, UnknownToken)
            same = {"same_entry": True} if entry and state == "completed" and by_entry == entry else {}
            raise err(token_message(state, token), token=token, **same)
        pipe = self.client.pipeline(transaction=False)
        pipe.hget(self.keys.calls(sid), field)
        pipe.hget(self.keys.meta(sid), "agent_hash")
        raw, agent_hash = pipe.execute()
        if raw is None or agent_hash is None:
            raise UnknownToken(token_message("unknown", token), token=token)
        return TrackedCall.model_validate_json(raw), agent_hash

    def record_result(
        self,
        session_id: str,
        field: str,
        outcome: str,
        event: dict[str, Any],
        refused: bool = False,
        counts: Counts | None = None,
        owner: str = "",
    ) -> Finished:
        """Record a dispatched call's outcome (first writer wins); `refused`: the worker ran nothing,
        the stored call disagreeing with the signed spec (the event is `call_refused`). `counts`:
        what running it counted, added to the fleet's counters by the writer that wins. `owner`:
        the worker that ran it under the call's lease: refused (status `lost`) while another
        holds that lease."""
        counted = counts_json(counts) if counts else ""
        args = [field, outcome, json.dumps(event), "1" if refused else "0", counted, owner]
        lease = (self.keys.call_lease(session_id, field),) if owner else ()
        # The call ran (or was refused): its outcome is written however long Redis stays away.
        res = self._run("record_result", session_id, args, extra_keys=lease, effect=True)
        if res[0] != "ok":
            return Finished(status=res[0])
        return Finished(
            status="ok", remaining=int(res[1]), woken=bool(res[2]), version=int(res[3]), priority=int(res[4])
        )

    def complete_token(
        self,
        token: str,
        outcome: str,
        by: str = "",
        event: dict[str, Any] | None = None,
        now: float | None = None,
        entry: str = "",
        decision: Decision | None = None,
    ) -> tuple[CompletionOutcome, int]:
        """Complete a deferred call; returns the outcome and the session's version, or raises the
        token's conflict (unknown, completed, expired, cancelled). When this very call found the
        deadline passed and expired it, the raised `TokenExpired` carries `wake_version` if the
        session must now be woken. `entry`: the completions stream entry applied; the token
        completed by that same entry before raises `TokenAlreadyCompleted` with `same_entry`.
        `decision`: approve or reject an approval gate (`Decision`); an approved gate is returned
        with `delegated` (its field: publish the call)."""
        sid, secret = self._token_parts(token)
        tkey = self.keys.token(sid, secret)
        expired = outcome_json(CallState.EXPIRED, now=time.time() if now is None else now, attempts=0)
        approves = "0" if json.loads(outcome).get("state") == CallState.FAILED.value else "1"
        key = self.settings.spec_key
        res = self._run(
            "complete_token",
            sid,
            [
                outcome,
                by,
                json.dumps(event or {}),
                expired,
                approves,
                entry,
                *(decision.args(key, token) if decision else NO_DECISION_ARGS),
                # An approval's record carries the key's seal: a worker runs an approved call only
                # on a decision this script recorded through a holder of the key.
                decision_seal(key, token, decision.approved if decision else "") if key else "",
            ],
            extra_keys=(tkey,),
            now=now,
        )
        status = res[0]
        if status not in ("ok", "approved") or int(res[2]):
            # the session may still wait (other calls, or a completion that changed nothing but
            # its events): its events, brought back by this one, are packed again
            self.pack_waiting(sid)
        if status in ("ok", "approved"):
            return CompletionOutcome(
                token=token,
                session_id=sid,
                call_id=res[1],
                remaining=int(res[2]),
                woken=bool(res[3]),
                decision=_decided(decision),
                delegated=res[5] if status == "approved" else None,
                priority=int(res[5]) if status == "ok" else DEFAULT_PRIORITY,
            ), int(res[4])
        details: dict[str, Any] = {"token": token}
        if status == "applied":
            status, details["same_entry"] = "completed", True
        if status == "expired_now":
            status = "expired"
            if int(res[3]):
                details["wake_version"] = int(res[4])
                details["wake_priority"] = int(res[5])
        err = TOKEN_ERRORS.get(status, UnknownToken)
        raise err(token_message(status, token), **details)

    def record_rejection(
        self, token: str, reason: str, message: str, *, by: str = "", entry: str = "", now: float | None = None
    ) -> None:
        """Keep a completion that changed nothing where an operator sees it (`agents doctor`), and
        count it (`agents_completions_total{outcome=<reason>}`) in the same round trip."""
        now = time.time() if now is None else now
        shard = self._token_shard(token)
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(
            shard.rejected,
            {
                "token": token[:200],
                "reason": reason,
                "message": message[:500],
                "by": by[:200],
                "entry": entry,
                "at": repr(now),
            },
            maxlen=10_000,
            approximate=True,
        )
        pipe.hincrby(shard.counters, counter_field(("completions", reason[:40])), 1)
        pipe.execute()

    def _token_parts(self, token: str) -> tuple[str, str]:
        """(session id, secret) of a token this system made: on index shards, a session id in no
        shard's slot names no session, so the token is unknown."""
        sid, secret = parse_token(token)
        if not self.keys.owns(sid):
            raise UnknownToken(token_message("unknown", token), token=token)
        return sid, secret

    def _token_shard(self, token: str) -> Keys:
        """The index shard of the session a token names; shard 0 for what names none."""
        sid = token.strip().partition(".")[0]
        return self.keys.for_session(sid) if self.keys.owns(sid) else self.keys

    def call_of_token(self, token: str) -> tuple[TrackedCall, str] | None:
        """The deferred call a token completes and its session's agent hash, or None (unknown
        token); two round trips, taken only when metrics or traces want the call."""
        try:
            sid, secret = self._token_parts(token)
        except UnknownToken:
            return None
        field = self.client.hget(self.keys.token(sid, secret), "field")
        if field is None:
            return None
        pipe = self.client.pipeline(transaction=False)
        pipe.hget(self.keys.calls(sid), field)
        pipe.hget(self.keys.meta(sid), "agent_hash")
        raw, agent_hash = pipe.execute()
        if raw is None:
            return None
        return TrackedCall.model_validate_json(raw), agent_hash or ""

    def expire_call(self, session_id: str, field: str, now: float | None = None) -> Finished:
        """Expire a deferred call if its deadline has passed by Redis's clock (or by `now`)."""
        raw = self.client.hget(self.keys.calls(session_id), field)
        if raw is None:
            self.client.zrem(self.keys.for_session(session_id).deadlines, f"{session_id} {field}")
            return Finished(status="gone")
        call = TrackedCall.model_validate_json(raw)
        if not call.token:
            self.client.zrem(self.keys.for_session(session_id).deadlines, f"{session_id} {field}")
            return Finished(status="gone")
        tkey = self.keys.token(session_id, parse_token(call.token)[1])
        outcome = outcome_json(CallState.EXPIRED, now=time.time() if now is None else now, attempts=0)
        res = self._run(
            "expire_call",
            session_id,
            [field, outcome, json.dumps({"call_id": call.call_id, "tool": call.tool})],
            extra_keys=(tkey,),
            now=now,
        )
        if res[0] != "ok":
            return Finished(status=res[0])
        return Finished(
            status="ok", remaining=int(res[1]), woken=bool(res[2]), version=int(res[3]), priority=int(res[4])
        )

    def extend_token(self, token: str, seconds: float) -> PendingCall:
        """Move a pending deferred call's deadline to now + `seconds` (Redis's clock); the call as
        `pending` lists it. The token's conflict when it was decided, expired or cancelled."""
        sid, secret = self._token_parts(token)
        res = self._run(
            "extend_token",
            sid,
            [int(seconds * 1000)],
            extra_keys=(self.keys.token(sid, secret), self.keys.for_session(sid).expiring),
        )
        if res[0] != "ok":
            err = TOKEN_ERRORS.get(res[0], UnknownToken)
            raise err(token_message(res[0], token), token=token)
        self.pack_waiting(sid)  # its `call_extended` brought the events back
        call, _ = self.token_call(token)
        stream = self.keys.for_session(sid).completions
        return pending_view(sid, call.model_copy(update={"expires_at": int(res[1]) / 1000}), stream=stream)

    def warn_due(self, now: float, limit: int = 100) -> int:
        """Write `call_expiring` for each deferred call whose warning is due (the worker sweeper);
        how many were written."""
        members = [m for m, _ in self.due("expiring", now, limit)]
        written = 0
        for member in members:
            sid, field = member.split(" ", 1)
            raw = self.client.hget(self.keys.calls(sid), field)
            call = TrackedCall.model_validate_json(raw) if raw else None
            expiring = self.keys.for_session(sid).expiring
            if call is None or not call.token:
                self.client.zrem(expiring, member)
                continue
            tkey = self.keys.token(sid, parse_token(call.token)[1])
            # `now` picked what is due; the script needs no time of its own (its event's is its id's)
            res = self._run("warn_call", sid, [field], extra_keys=(tkey, expiring), clock="event")
            if res[0] == "ok":
                written += 1
                self.pack_waiting(sid)  # its `call_expiring` brought the events back
        return written

    def due_deadlines(self, now: float, limit: int = 100) -> list[tuple[str, str]]:
        members = [m for m, _ in self.due("deadlines", now, limit)]
        # Members are written "<session id> <field>" (store/lua/): each splits in two.
        return [cast("tuple[str, str]", tuple(m.split(" ", 1))) for m in members]

    def expire_due(self, now: float | None = None) -> list[tuple[str, Finished]]:
        """Expire every deferred call whose deadline has passed (what the worker sweeper does);
        returns (session id, what expiring did) for each."""
        now = self.server_time() if now is None else now
        return [(sid, self.expire_call(sid, field, now=now)) for sid, field in self.due_deadlines(now)]
