"""Sessions as a whole: create, find by id prefix, drive, step through, cancel, delete and purge."""

from __future__ import annotations

import contextlib
import json
import time
from typing import cast

from celery_agents.errors import InvalidInput, SessionNotAdvanceable, UnknownSession
from celery_agents.model import AgentSpec, Budget, CallState, SessionHeader, TrackedCall, UserQuery, UserTurn
from celery_agents.model.admission import DEFAULT_PRIORITY, PRIORITY_MAX, PRIORITY_MIN
from celery_agents.store.codec import outcome_json, turn_digest
from celery_agents.store.core import StoreCore
from celery_agents.store.header import header_from_hash, header_to_stored
from celery_agents.store.ids import SESSION_ID, check_session_id, parse_token
from celery_agents.store.keys import STORED_STATES
from celery_agents.store.records import Sent
from celery_agents.store.signing import sign_spec
from celery_agents.store.summary import start_summary


class SessionStore(StoreCore):
    """Creating, finding, driving, cancelling and deleting sessions."""

    def create_session(
        self,
        agent: AgentSpec,
        query: UserQuery,
        *,
        drive: str = "manual",
        owe: bool = False,
        session_id: str | None = None,
        now: float | None = None,
        parent: tuple[str, str] | None = None,
        ancestors: list[str] | None = None,
        bounded_by: list[str] | None = None,
        priority: int | None = None,
    ) -> SessionHeader:
        """Store a new session; `parent` is (session, call field) of the sub-agent call starting it,
        `ancestors` the sessions above it, its parent first, `bounded_by` those with a budget;
        `priority` (0-9) over the agent file's (default 5)."""
        stamp = time.time() if now is None else now  # shown only: the script stamps created_at from Redis
        sid = check_session_id(session_id) if session_id else self.keys.new_session_id()
        if not self.keys.owns(sid):
            raise InvalidInput(
                f"session id {sid[:80]!r} is in no index shard's hash slot (AGENTS_INDEX_SHARDS="
                f"{self.keys.shards}): on a Redis Cluster, celery-agents makes session ids"
            )
        shard = self.keys.for_session(sid)
        spec_json = agent.to_json()
        content_hash = agent.content_hash()
        header = SessionHeader(
            session_id=sid,
            agent_slug=agent.slug,
            agent_hash=content_hash,
            execution_mode=agent.mode,
            drive=drive,
            created_at=stamp,
            updated_at=stamp,
            step_limit=agent.max_steps,
            turn_count=1,
            parent=parent[0] if parent else None,
            parent_call=parent[1] if parent else None,
            budget=agent.budget,
            ancestors=ancestors or ([parent[0]] if parent else []),
            bounded_by=bounded_by or [],
            priority=_priority(priority, agent),
        )
        first_turn = UserTurn(query=query, at=stamp).model_dump_json(exclude_none=True)
        header.turns_digest = turn_digest("", [first_turn])
        res = self._run(
            "create_session",
            sid,
            [
                json.dumps(header_to_stored(header)),
                first_turn,
                spec_json,
                "1" if owe else "0",
                sign_spec(self.settings.spec_key, spec_json) if self.settings.spec_key else "",
                start_summary(query),
            ],
            extra_keys=(shard.agent(content_hash), shard.ids, shard.agent_signature(content_hash)),
            now=now,
        )
        if res[0] != "ok":
            raise SessionNotAdvanceable(f"session {sid} already exists")
        self._agents[content_hash] = agent
        return header

    def start_child(
        self, parent_id: str, call_field: str, child_id: str, agent: AgentSpec, query: UserQuery
    ) -> int | None:
        """Start the child session of a sub-agent call, auto-driven and owed its first step, unless
        it exists already (an earlier attempt made it): returns the child's priority (its agent
        file's, else its parent's) if this call made it, else None. The parent lists it first, so
        that a crash in between leaves it findable (cancel reaches it)."""
        self.client.sadd(self.keys.children(parent_id), child_id)
        above = self.header(parent_id)
        bounded = [parent_id] if above.budget is not None else []
        priority = agent.priority if agent.priority is not None else above.priority
        try:
            self.create_session(
                agent,
                query,
                drive="auto",
                owe=True,
                session_id=child_id,
                parent=(parent_id, call_field),
                ancestors=[parent_id, *above.ancestors],
                bounded_by=[*bounded, *above.bounded_by],
                priority=priority,
            )
        except SessionNotAdvanceable:
            return None
        return priority

    def children(self, session_id: str) -> list[str]:
        """The child sessions the session's sub-agent calls started."""
        return sorted(cast("set[str]", self.client.smembers(self.keys.children(session_id))))

    def tree(self, session_id: str) -> list[str]:
        """The session and every session below it (children, theirs...), parents first."""
        out, todo = [], [session_id]
        while todo:
            sid = todo.pop(0)
            out.append(sid)
            todo += self.children(sid)
        return out

    def tree_pending_calls(self, session_id: str) -> list[TrackedCall]:
        """The unfinished calls of the session and of every session below it; a child listed
        but not made yet (or deleted since, as retention does before its parent) has none."""
        out = self.pending_calls(session_id)
        for sid in self.tree(session_id)[1:]:
            with contextlib.suppress(UnknownSession):
                out += self.pending_calls(sid)
        return out

    def send_message(self, session_id: str, query: UserQuery, interrupt: bool = False) -> Sent:
        """Queue a user message for the session's next model call (a completed session becomes
        ready again and the message continues it); `interrupt`: a model call of the session in
        flight that does not include it is cancelled (store/live.py)."""
        check_session_id(session_id)
        limit = self.settings.max_queued_messages
        channel = self.keys.interrupts if interrupt else ""
        res = self._run("send_message", session_id, [query.model_dump_json(exclude_defaults=True), limit, channel])
        if res[0] == "missing":
            raise UnknownSession(f"unknown session {session_id!r}", session_id=session_id)
        if res[0] == "ended":
            raise SessionNotAdvanceable(
                f"session {session_id} is {res[1]}: it takes no more messages", session_id=session_id, status=res[1]
            )
        if res[0] == "full":
            raise InvalidInput(
                f"session {session_id} already has {res[1]} messages waiting (the limit): send more once it "
                "has taken them"
            )
        return Sent(version=int(res[1]), waiting=int(res[2]), continued=bool(int(res[3])))

    def resolve(self, session_id: str) -> str:
        """The whole id of the one session whose id starts with `session_id` (an exact id wins);
        one ZRANGEBYLEX on the id index, never a scan."""
        text = session_id.strip()
        if not text:
            raise InvalidInput("no session id given: give a session id, or any unique prefix of one")
        if not SESSION_ID.match(text):
            raise UnknownSession(f"unknown session {text[:80]!r}", session_id=text)
        found = self._ids_from(text)
        if text in found:
            return text
        if len(found) == 1:
            return found[0]
        if not found:
            raise UnknownSession(f"unknown session {text!r}: no session id starts with it", session_id=text)
        raise InvalidInput(
            f"session id prefix {text!r} is ambiguous: it starts {', '.join(found[:3])}"
            f"{' and more' if len(found) > 3 else ''} (give more characters)"
        )

    def _ids_from(self, prefix: str) -> list[str]:
        # '~' sorts after every character a session id may hold; the first 4 of every shard's.
        pipe = self.client.pipeline(transaction=False)
        for shard in self.keys.all_shards():
            pipe.zrangebylex(shard.ids, f"[{prefix}", f"({prefix}~", start=0, num=4)
        return sorted(sid for found in pipe.execute() for sid in found)[:4]

    def set_drive(
        self, session_id: str, drive: str, grant: Budget | None = None, header: SessionHeader | None = None
    ) -> tuple[int, bool]:
        """Pause ("manual") or resume ("auto", its budget's limits raised by `grant`); returns
        (version, whether a step is now owed). `header`: the session's, read just before."""
        check_session_id(session_id)
        h = header or self.header(session_id)
        more = grant.model_dump_json(exclude_none=True) if grant is not None else ""
        res = self._run("set_drive", session_id, [drive, self.agent(h.agent_hash, session_id).max_steps, more])
        if res[0] == "missing":
            raise UnknownSession(f"unknown session {session_id!r}", session_id=session_id)
        if res[0] == "ended":
            raise SessionNotAdvanceable(
                f"session {session_id} is {res[1]}: it cannot be resumed or paused",
                session_id=session_id,
                status=res[1],
            )
        return int(res[1]), bool(res[2])

    def prepare_step(self, session_id: str, header: SessionHeader | None = None) -> int:
        """Make a session steppable (a failed one becomes active); returns its version. `header`:
        the session's, read just before."""
        h = header or self.header(session_id)
        res = self._run("step_through", session_id, [self.agent(h.agent_hash, session_id).max_steps])
        if res[0] == "missing":
            raise UnknownSession(f"unknown session {session_id!r}", session_id=session_id)
        if res[0] == "ended":
            raise SessionNotAdvanceable(
                f"session {session_id} is {res[1]}: it cannot take another step", session_id=session_id, status=res[1]
            )
        return int(res[1])

    def cancel(self, session_id: str, now: float | None = None) -> int:
        stamp = time.time() if now is None else now
        unfinished = [c for c in self.pending_calls(session_id)]
        outcomes = {c.field: outcome_json(CallState.CANCELLED, now=stamp, attempts=c.attempts) for c in unfinished}
        tkeys = tuple(self.keys.token(session_id, parse_token(c.token)[1]) for c in unfinished if c.token)
        res = self._run("cancel_session", session_id, [json.dumps(outcomes)], extra_keys=tkeys, now=now)
        if res[0] == "missing":
            raise UnknownSession(f"unknown session {session_id!r}", session_id=session_id)
        if res[0] == "ended":
            raise SessionNotAdvanceable(
                f"session {session_id} is already {res[1]}", session_id=session_id, status=res[1]
            )
        return int(res[1])

    def delete_session(self, session_id: str, *, force: bool = False) -> int:
        """Delete a session that is not active (or any, with `force`, once it was cancelled):
        every key it owns and its entries in the shared indexes, atomically. Returns how many
        keys went; raises when a step or call of it is still running."""
        parent = cast("str | None", self.client.hget(self.keys.meta(session_id), "parent"))
        for _ in range(5):
            calls = cast("dict[str, str]", self.client.hgetall(self.keys.calls(session_id)))
            secrets = [parse_token(t)[1] for t in (json.loads(c).get("token") for c in calls.values()) if t]
            keys = self.keys.every_session_key(session_id, list(calls), secrets)
            shard = self.keys.for_session(session_id)
            extra = (shard.ids, shard.rewound, shard.expiring, *keys)
            res = self._run("delete_session", session_id, [len(calls), "1" if force else "0"], extra)
            if res[0] == "ok":
                if parent:  # the parent's list is under the parent's hash tag: a second command
                    self.client.srem(self.keys.children(parent), session_id)
                return int(res[1])
            if res[0] == "missing":
                raise UnknownSession(f"unknown session {session_id!r}", session_id=session_id)
            if res[0] == "active":
                raise SessionNotAdvanceable(
                    f"session {session_id} is still active ({res[1]}): cancel it first "
                    f"(agents session cancel {session_id}) or delete with --force",
                    session_id=session_id,
                    status="active",
                )
            if res[0] == "busy":
                raise SessionNotAdvanceable(
                    f"session {session_id} has a step or call running; delete it when that ends",
                    session_id=session_id,
                    status="running",
                )
        raise SessionNotAdvanceable(f"session {session_id} keeps changing; try again", session_id=session_id)

    def purge(self, states: list[str], cutoff: float, limit: int | None = None) -> list[str]:
        """Delete sessions in `states` last updated before `cutoff` (seconds, Redis's clock),
        oldest first, at most `limit`; a session that changed meanwhile (resumed, running) is
        left alone. Returns the ids deleted."""
        deleted: list[str] = []
        while limit is None or len(deleted) < limit:
            want = 200 if limit is None else min(200, limit - len(deleted))
            batch = self.finished_before(states, cutoff, want)
            done = [sid for sid in batch if self._delete_if_idle(sid)]
            deleted += done
            if len(batch) < want or not done:
                break
        return deleted

    def _delete_if_idle(self, session_id: str) -> bool:
        try:
            self.delete_session(session_id)
        except (SessionNotAdvanceable, UnknownSession):
            return False
        return True

    def finished_before(self, states: list[str], cutoff: float, limit: int) -> list[str]:
        """Ids of sessions in `states` last updated before `cutoff` (seconds), oldest first."""
        pipe = self.client.pipeline(transaction=False)
        for st in states:
            for shard in self.keys.all_shards():
                pipe.zrangebyscore(
                    shard.state_index(st), "-inf", f"({int(cutoff * 1000)}", start=0, num=limit, withscores=True
                )
        rows = [row for chunk in pipe.execute() for row in chunk]
        return [sid for sid, _ in sorted(rows, key=lambda r: r[1])[:limit]]

    def memory_per_session(self, sample: int = 20) -> tuple[int, int]:
        """(sessions sampled, their bytes in Redis) over the most recently updated sessions."""
        ids = self._newest(None, sample)
        pipe = self.client.pipeline(transaction=False)
        for sid in ids:
            for key in self.keys.session_keys(sid):
                pipe.memory_usage(key)
        sizes = pipe.execute()
        return len(ids), sum(int(x or 0) for x in sizes)

    def list_sessions(self, state: str | None = None, limit: int = 50) -> list[SessionHeader]:
        ids = self._newest(state, limit)
        pipe = self.client.pipeline(transaction=False)
        for sid in ids:
            pipe.hgetall(self.keys.meta(sid))
        return [header_from_hash(d, sid) for sid, d in zip(ids, pipe.execute(), strict=True) if d]

    def _newest(self, state: str | None, limit: int) -> list[str]:
        """The ids of the `limit` sessions (in `state`, else in any) updated last, newest first:
        the newest `limit` of each state index asked (of each shard), merged. Every session is in
        the index of its stored state, so no index of all sessions is kept beside them."""
        states = (state,) if state else STORED_STATES
        indexes = [shard.state_index(s) for shard in self.keys.all_shards() for s in states]
        if len(indexes) == 1:
            return cast("list[str]", self.client.zrevrange(indexes[0], 0, limit - 1))
        pipe = self.client.pipeline(transaction=False)
        for index in indexes:
            pipe.zrevrange(index, 0, limit - 1, withscores=True)
        rows = [row for chunk in pipe.execute() for row in chunk]
        return [sid for sid, _ in sorted(rows, key=lambda r: -r[1])[:limit]]

    def headers(self, session_ids: list[str]) -> dict[str, SessionHeader]:
        """The headers of the sessions named that still exist, in one pipelined round trip."""
        pipe = self.client.pipeline(transaction=False)
        for sid in session_ids:
            pipe.hgetall(self.keys.meta(sid))
        return {sid: header_from_hash(d, sid) for sid, d in zip(session_ids, pipe.execute(), strict=True) if d}

    def state_counts(self) -> dict[str, int]:
        """Sessions per stored state, from the state indexes (one round trip, never a scan)."""
        pipe = self.client.pipeline(transaction=False)
        for state in STORED_STATES:
            for shard in self.keys.all_shards():
                pipe.zcard(shard.state_index(state))
        counts = iter(pipe.execute())
        return {state: sum(int(next(counts)) for _ in self.keys.all_shards()) for state in STORED_STATES}


def _priority(given: int | None, agent: AgentSpec) -> int:
    """A new session's priority: the one asked for, else its agent file's, else the default."""
    if given is not None:
        if not PRIORITY_MIN <= given <= PRIORITY_MAX:
            raise InvalidInput(f"a priority is {PRIORITY_MIN} (lowest) to {PRIORITY_MAX} (highest); got {given}")
        return given
    return agent.priority if agent.priority is not None else DEFAULT_PRIORITY
