"""Calls after their step: outcomes recorded, tokens completed, rejected or expired, deadlines due."""

from __future__ import annotations

import json
import time
from typing import Any, cast

from celery_agents.errors import TOKEN_ERRORS, UnknownToken
from celery_agents.model import CallState, CompletionOutcome, TrackedCall
from celery_agents.store.codec import merge_outcome, outcome_json, token_message
from celery_agents.store.core import StoreCore
from celery_agents.store.ids import check_session_id, parse_token
from celery_agents.store.records import Finished


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

    def record_result(self, session_id: str, field: str, outcome: str, event: dict[str, Any]) -> Finished:
        res = self._run("record_result", session_id, [field, outcome, json.dumps(event)])
        if res[0] != "ok":
            return Finished(status=res[0])
        return Finished(status="ok", remaining=int(res[1]), woken=bool(res[2]), version=int(res[3]))

    def complete_token(
        self, token: str, outcome: str, by: str = "", event: dict[str, Any] | None = None, now: float | None = None
    ) -> tuple[CompletionOutcome, int]:
        """Complete a deferred call; returns the outcome and the session's version, or raises the
        token's conflict (unknown, completed, expired, cancelled). When this very call found the
        deadline passed and expired it, the raised `TokenExpired` carries `wake_version` if the
        session must now be woken."""
        sid, secret = parse_token(token)
        tkey = self.keys.token(sid, secret)
        expired = outcome_json(CallState.EXPIRED, now=time.time() if now is None else now, attempts=0)
        approves = "0" if json.loads(outcome).get("state") == CallState.FAILED.value else "1"
        res = self._run(
            "complete_token",
            sid,
            [outcome, by, json.dumps(event or {}), expired, approves],
            extra_keys=(tkey,),
            now=now,
        )
        status = res[0]
        if status in ("ok", "approved"):
            return CompletionOutcome(
                token=token,
                session_id=sid,
                call_id=res[1],
                remaining=int(res[2]),
                woken=bool(res[3]),
                delegated=res[5] if status == "approved" else None,
            ), int(res[4])
        details: dict[str, Any] = {"token": token}
        if status == "expired_now":
            status = "expired"
            if int(res[3]):
                details["wake_version"] = int(res[4])
        err = TOKEN_ERRORS.get(status, UnknownToken)
        raise err(token_message(status, token), **details)

    def record_rejection(
        self, token: str, reason: str, message: str, *, by: str = "", entry: str = "", now: float | None = None
    ) -> None:
        """Keep a completion that changed nothing where an operator sees it (`agents doctor`)."""
        now = time.time() if now is None else now
        self.client.xadd(
            self.keys.rejected,
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

    def call_of_token(self, token: str) -> tuple[TrackedCall, str] | None:
        """The deferred call a token completes and its session's agent hash, or None (unknown
        token); two round trips, taken only when metrics or traces want the call."""
        try:
            sid, secret = parse_token(token)
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
            self.client.zrem(self.keys.deadlines, f"{session_id} {field}")
            return Finished(status="gone")
        call = TrackedCall.model_validate_json(raw)
        if not call.token:
            self.client.zrem(self.keys.deadlines, f"{session_id} {field}")
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
        return Finished(status="ok", remaining=int(res[1]), woken=bool(res[2]), version=int(res[3]))

    def due_deadlines(self, now: float, limit: int = 100) -> list[tuple[str, str]]:
        members = cast(
            "list[str]", self.client.zrangebyscore(self.keys.deadlines, "-inf", int(now * 1000), start=0, num=limit)
        )
        # Members are written "<session id> <field>" (store/lua/): each splits in two.
        return [cast("tuple[str, str]", tuple(m.split(" ", 1))) for m in members]

    def expire_due(self, now: float | None = None) -> list[tuple[str, Finished]]:
        """Expire every deferred call whose deadline has passed (what the worker sweeper does);
        returns (session id, what expiring did) for each."""
        now = self.server_time() if now is None else now
        return [(sid, self.expire_call(sid, field, now=now)) for sid, field in self.due_deadlines(now)]
