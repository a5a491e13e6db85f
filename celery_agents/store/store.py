"""Session persistence in Redis: create, load, commit, journal, results, tokens, drive, cancel.

Every write that must be atomic is one script of `store/lua/`; reads are single round trips
(a script or a pipeline). Writes per step carry only the step's new turns and calls.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import re
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, cast

import redis
from pydantic import TypeAdapter
from redis.lock import Lock

from celery_agents.config import Settings
from celery_agents.errors import (
    TOKEN_ERRORS,
    InvalidInput,
    RedisUnavailable,
    SessionNotAdvanceable,
    UnknownSession,
    UnknownToken,
    UntrustedSpec,
)
from celery_agents.model import (
    AgentSpec,
    CallState,
    CompletionOutcome,
    ErrorInfo,
    LlmTurn,
    PendingCall,
    SessionHeader,
    State,
    Status,
    StoredTurn,
    TrackedCall,
    Usage,
    UserQuery,
    UserTurn,
)
from celery_agents.store.keys import Keys
from celery_agents.store.scripts import Scripts
from celery_agents.store.signing import sign_spec, spec_verifies

log = logging.getLogger("celery_agents.store")

#: A step's journal outlives any step that could still reuse it (redelivery comes within hours).
JOURNAL_TTL_S = 86400

_SID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_SECRET = re.compile(r"^[A-Za-z0-9_-]{16,128}$")
_TURN: TypeAdapter[UserTurn | LlmTurn] = TypeAdapter(StoredTurn)

# Replies are text: the client is made with `decode_responses=True` (store/connection.py), but
# redis-py types a reply `bytes | str` whatever the client, hence the casts to `str` below.
# A stream's entries as XRANGE and XREAD (RESP2) return them: (entry id, fields).
_Entries = list[tuple[str, dict[str, str]]]


def new_session_id() -> str:
    return uuid.uuid4().hex


def new_token(session_id: str) -> str:
    """A continuation token: the session id, a dot, and 144 random bits."""
    return f"{session_id}.{secrets.token_urlsafe(18)}"


def parse_token(token: str) -> tuple[str, str]:
    sid, dot, secret = token.strip().partition(".")
    if not dot or not _SID.match(sid) or not _SECRET.match(secret):
        raise UnknownToken(f"unknown token {token.strip()[:80]!r}: it is not a token this system made", token=token)
    return sid, secret


def check_session_id(session_id: str) -> str:
    if not _SID.match(session_id):
        raise UnknownSession(f"unknown session {session_id[:80]!r}", session_id=session_id)
    return session_id


class LeaseLost(Exception):
    """A step's session lease is held by another worker, or the session moved past the step's
    version: the step must start nothing more and write nothing (fencing)."""


@dataclass
class Loaded:
    """A session as a step reads it."""

    header: SessionHeader
    turns: list[UserTurn | LlmTurn]
    calls: list[TrackedCall]
    lease_holder: str
    journal: dict[str, str]
    #: Redis's clock when the step began (seconds; 0 when not read): the step's times come from it
    redis_now: float = 0.0
    #: user messages sent meanwhile (`session send`), oldest first, not yet delivered
    inbox: list[UserQuery] = dataclasses.field(default_factory=list)


@dataclass
class Finished:
    """What recording a call's outcome did."""

    status: str
    remaining: int = 0
    woken: bool = False
    version: int = 0


@dataclass(frozen=True)
class _Transcript:
    """The turns of one session this process has read, with their digest and the version seen.
    Never changed once cached (a commit caches a new one): steps in other threads of the process
    may be reading it."""

    turns: list[UserTurn | LlmTurn]
    digest: str
    version: int


def turn_digest(previous: str, raw_turns: list[str]) -> str:
    """The digest of a transcript after appending `raw_turns` (JSON exactly as stored) to one whose
    digest is `previous` ("" for none): equal digests, equal turns, whatever their count."""
    digest = previous
    for raw in raw_turns:
        digest = hashlib.sha256(f"{digest}\n{raw}".encode()).hexdigest()[:32]
    return digest


class Live(NamedTuple):
    """What a session's view shows besides its header."""

    pending: list[PendingCall]
    leased: bool
    children: list[str]


#: what the sweeper does with an outbox entry or a dispatched call (store/lua/sweep_*.lua)
SweepVerdict = Literal["settled", "running", "waiting", "republish"]


@dataclass
class Swept:
    """One outbox entry (`field` None) or dispatched call as the sweeper settled it; `version` is
    the step to publish again, `call` the call to publish again."""

    session_id: str
    verdict: SweepVerdict
    field: str | None = None
    version: int = 0
    call: TrackedCall | None = None


def _s(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def header_to_hash(h: SessionHeader) -> dict[str, str]:
    return {
        "session_id": h.session_id,
        "agent_slug": h.agent_slug,
        "agent_hash": h.agent_hash,
        "execution_mode": h.execution_mode,
        "version": _s(h.version),
        "status": h.status.value,
        "state": h.state.value,
        "drive": h.drive,
        "head": h.head or "",
        "created_at": repr(h.created_at),
        "updated_at": repr(h.updated_at),
        "steps": _s(h.steps),
        "step_limit": _s(h.step_limit),
        "turn_count": _s(h.turn_count),
        "turns_digest": h.turns_digest,
        "usage": h.usage.model_dump_json(exclude_defaults=True),
        "error": h.error.model_dump_json() if h.error else "",
        "response": json.dumps(h.response),
        **({"parent": h.parent, "parent_call": h.parent_call or ""} if h.parent else {}),
    }


def header_from_hash(d: dict[str, str]) -> SessionHeader:
    return SessionHeader(
        session_id=d["session_id"],
        agent_slug=d.get("agent_slug", ""),
        agent_hash=d.get("agent_hash", ""),
        execution_mode=d.get("execution_mode") or "synchronous",
        version=int(d.get("version", "1")),
        status=Status(d.get("status", "active")),
        state=State(d.get("state", "ready")),
        drive=d.get("drive") or "manual",
        head=d.get("head") or None,
        created_at=float(d.get("created_at", 0)),
        updated_at=float(d.get("updated_at", 0)),
        steps=int(d.get("steps", 0)),
        step_limit=int(d.get("step_limit", 40)),
        turn_count=int(d.get("turn_count", 0)),
        turns_digest=d.get("turns_digest", ""),
        usage=Usage.model_validate_json(d["usage"]) if d.get("usage") else Usage(),
        error=ErrorInfo.model_validate_json(d["error"]) if d.get("error") else None,
        response=json.loads(d["response"]) if d.get("response") else None,
        parent=d.get("parent") or None,
        parent_call=d.get("parent_call") or None,
    )


def merge_outcome(call_json: str, outcome_json: str | None) -> TrackedCall:
    data = json.loads(call_json)
    if outcome_json:
        data.update(json.loads(outcome_json))
    return TrackedCall.model_validate(data)


def completion_json(result: Any, *, is_error: bool, by: str | None, now: float) -> str:
    """The outcome recorded when a deferred call is completed from outside."""
    if is_error:
        text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
        return outcome_json(CallState.FAILED, error=text, now=now, completed_by=by, attempts=1)
    return outcome_json(CallState.COMPLETED, result=result, now=now, completed_by=by, attempts=1)


def outcome_json(
    state: CallState,
    *,
    result: Any = None,
    error: str | None = None,
    now: float,
    duration_ms: float | None = None,
    exit_status: int | None = None,
    attempts: int | None = None,
    completed_by: str | None = None,
    meta: dict[str, Any] | None = None,
    started_at: float | None = None,
) -> str:
    """The JSON a final outcome is recorded as (merged over the call when read)."""
    body: dict[str, Any] = {"state": state.value, "finished_at": now}
    if state == CallState.COMPLETED:
        body["result"] = result
    if error is not None:
        body["error"] = error
    for k, v in (
        ("duration_ms", duration_ms),
        ("exit_status", exit_status),
        ("attempts", attempts),
        ("completed_by", completed_by),
        ("meta", meta),
        ("started_at", started_at),
    ):
        if v is not None:
            body[k] = v
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


class Store:
    """Session state in Redis under one key prefix."""

    def __init__(self, client: redis.Redis, settings: Settings | None = None) -> None:
        self.client = client
        self.settings = settings or Settings()
        self.keys = Keys(self.settings.prefix)
        self.scripts = Scripts(client)
        self._agents: dict[str, AgentSpec] = {}
        self._turn_cache: OrderedDict[str, _Transcript] = OrderedDict()
        self._turn_lock = threading.Lock()

    # -- plumbing ----------------------------------------------------------------------------
    def _run(
        self,
        name: str,
        sid: str,
        args: list[Any],
        extra_keys: tuple[str, ...] = (),
        now: float | None = None,
        pipe: Any = None,
    ) -> Any:
        # One id per call: the client's retries after a lost reply resend it, and the script
        # answers them with the first reply (`once` in store/lua/_lib.lua).
        keys = self.keys.script_keys(sid, uuid.uuid4().hex, *extra_keys)
        try:
            # No `now`: the script reads Redis's clock (durable times never come from a worker's).
            stamp = "" if now is None else repr(now)
            return self.scripts.run(name, keys, [stamp, self.settings.events_maxlen, sid, *args], client=pipe)
        except redis.ConnectionError as exc:
            raise RedisUnavailable(f"cannot reach Redis: {exc}") from exc

    def ping(self) -> None:
        try:
            self.client.ping()
        except redis.ConnectionError as exc:
            raise RedisUnavailable(f"cannot reach Redis: {exc}") from exc

    # -- agents ------------------------------------------------------------------------------
    def agent(self, content_hash: str) -> AgentSpec:
        """The agent spec stored under a hash, cached in this process (specs never change)."""
        spec = self._agents.get(content_hash)
        if spec is None:
            key = self.settings.spec_key
            raw, signature = cast(
                "list[str | None]",
                self.client.mget([self.keys.agent(content_hash), self.keys.agent_signature(content_hash)]),
            )
            if raw is None:
                raise UnknownSession(f"the agent spec {content_hash} is missing from Redis")
            if key is not None and not spec_verifies(key, raw, signature):
                raise UntrustedSpec(
                    f"the agent spec {content_hash} is not signed with this worker's AGENTS_SPEC_KEY: nothing of it "
                    "runs (store it again through the CLI or the API with the key set)",
                    agent_hash=content_hash,
                )
            spec = AgentSpec.from_json(raw)
            self._agents[content_hash] = spec
        return spec

    # -- sessions ----------------------------------------------------------------------------
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
    ) -> SessionHeader:
        """Store a new session; `parent` is (session, call field) of the sub-agent call starting it."""
        stamp = time.time() if now is None else now  # shown only: the script stamps created_at from Redis
        sid = check_session_id(session_id) if session_id else new_session_id()
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
        )
        first_turn = UserTurn(query=query, at=stamp).model_dump_json(exclude_none=True)
        header.turns_digest = turn_digest("", [first_turn])
        res = self._run(
            "create_session",
            sid,
            [
                json.dumps(header_to_hash(header)),
                first_turn,
                spec_json,
                "1" if owe else "0",
                sign_spec(self.settings.spec_key, spec_json) if self.settings.spec_key else "",
            ],
            extra_keys=(self.keys.agent(content_hash), self.keys.ids, self.keys.agent_signature(content_hash)),
            now=now,
        )
        if res[0] != "ok":
            raise SessionNotAdvanceable(f"session {sid} already exists")
        self._agents[content_hash] = agent
        return header

    def start_child(
        self, parent: SessionHeader, call_field: str, child_id: str, agent: AgentSpec, query: UserQuery
    ) -> bool:
        """Start the child session of a sub-agent call, auto-driven and owed its first step, unless
        it exists already (an earlier attempt made it): returns whether this call made it. The
        parent lists it first, so that a crash in between leaves it findable (cancel reaches it)."""
        self.client.sadd(self.keys.children(parent.session_id), child_id)
        try:
            self.create_session(
                agent, query, drive="auto", owe=True, session_id=child_id, parent=(parent.session_id, call_field)
            )
        except SessionNotAdvanceable:
            return False
        return True

    def call(self, session_id: str, field: str) -> TrackedCall:
        """One tracked call as its step created it (without its outcome)."""
        raw = self.client.hget(self.keys.calls(session_id), field)
        if raw is None:
            raise UnknownSession(f"session {session_id!r} has no call {field}", session_id=session_id)
        return TrackedCall.model_validate_json(raw)

    def children(self, session_id: str) -> list[str]:
        return sorted(cast("set[str]", self.client.smembers(self.keys.children(session_id))))

    def header(self, session_id: str) -> SessionHeader:
        check_session_id(session_id)
        try:
            data = cast("dict[str, str]", self.client.hgetall(self.keys.meta(session_id)))
        except redis.ConnectionError as exc:
            raise RedisUnavailable(f"cannot reach Redis: {exc}") from exc
        if not data:
            raise UnknownSession(f"unknown session {session_id!r}", session_id=session_id)
        return header_from_hash(data)

    def resolve(self, session_id: str) -> str:
        """The whole id of the one session whose id starts with `session_id` (an exact id wins);
        one ZRANGEBYLEX on the id index, never a scan."""
        text = session_id.strip()
        if not _SID.match(text):
            raise UnknownSession(f"unknown session {text[:80]!r}", session_id=text)
        found = self._ids_from(text)
        if not found and self._index_ids():
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
        # '~' sorts after every character a session id may hold.
        return cast("list[str]", self.client.zrangebylex(self.keys.ids, f"[{prefix}", f"({prefix}~", start=0, num=4))

    def _index_ids(self) -> bool:
        """Sessions made before the id index existed join it (once: afterwards both counts match)."""
        if int(self.client.zcard(self.keys.ids)) >= int(self.client.zcard(self.keys.sessions)):
            return False
        ids = cast("list[str]", self.client.zrange(self.keys.sessions, 0, -1))
        for i in range(0, len(ids), 1000):
            self.client.zadd(self.keys.ids, dict.fromkeys(ids[i : i + 1000], 0))
        return True

    def delete_session(self, session_id: str, *, force: bool = False) -> int:
        """Delete a session that is not active (or any, with `force`, once it was cancelled):
        every key it owns and its entries in the shared indexes, atomically. Returns how many
        keys went; raises when a step or call of it is still running."""
        for _ in range(5):
            calls = cast("dict[str, str]", self.client.hgetall(self.keys.calls(session_id)))
            secrets = [parse_token(t)[1] for t in (json.loads(c).get("token") for c in calls.values()) if t]
            keys = self.keys.every_session_key(session_id, list(calls), secrets)
            extra = (self.keys.ids, self.keys.rewound, *keys)
            res = self._run("delete_session", session_id, [len(calls), "1" if force else "0"], extra)
            if res[0] == "ok":
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
            pipe.zrangebyscore(
                self.keys.state_index(st), "-inf", f"({int(cutoff * 1000)}", start=0, num=limit, withscores=True
            )
        rows = [row for chunk in pipe.execute() for row in chunk]
        return [sid for sid, _ in sorted(rows, key=lambda r: r[1])[:limit]]

    def server_time(self) -> float:
        """Redis's clock (seconds): durable cutoffs are measured against it, not a host's clock."""
        sec, usec = self.client.time()
        return sec + usec / 1_000_000

    def memory_per_session(self, sample: int = 20) -> tuple[int, int]:
        """(sessions sampled, their bytes in Redis) over the most recently updated sessions."""
        ids = cast("list[str]", self.client.zrevrange(self.keys.sessions, 0, sample - 1))
        pipe = self.client.pipeline(transaction=False)
        for sid in ids:
            for key in self.keys.session_keys(sid):
                pipe.memory_usage(key)
        sizes = pipe.execute()
        return len(ids), sum(int(x or 0) for x in sizes)

    def lease_holder(self, session_id: str) -> str | None:
        return cast("str | None", self.client.get(self.keys.lease(session_id)))

    def load(self, session_id: str) -> Loaded:
        """Header, all stored turns, the newest batch's calls: one round trip (turns cached)."""
        check_session_id(session_id)
        seen = self._turn_cache.get(session_id)
        res = self._run("load_session", session_id, [len(seen.turns) if seen else 0])
        if not res:
            raise UnknownSession(f"unknown session {session_id!r}", session_id=session_id)
        return self._loaded(session_id, res, seen)

    def _loaded(self, session_id: str, payload: list[Any], seen: _Transcript | None) -> Loaded:
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
        self, session_id: str, header: SessionHeader, raw_turns: list[str], seen: _Transcript | None
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
            turns = cached + [_TURN.validate_json(t) for t in raw_turns]
        else:
            raws = cast("list[str]", self.client.lrange(self.keys.turns(session_id), 0, -1))
            turns = [_TURN.validate_json(t) for t in raws]
            digest = turn_digest("", raws) if header.turns_digest else ""
        self._remember(session_id, _Transcript(turns, digest, header.version))
        return list(turns)

    def _remember(self, session_id: str, transcript: _Transcript) -> None:
        """Cache a session's transcript, the most recently used 512 kept (threads share the cache)."""
        with self._turn_lock:
            self._turn_cache[session_id] = transcript
            self._turn_cache.move_to_end(session_id)
            while len(self._turn_cache) > 512:
                self._turn_cache.popitem(last=False)

    def _went_back(self, session_id: str, seen: _Transcript, stored: SessionHeader) -> None:
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
        return [_TURN.validate_json(t) for t in self.client.lrange(self.keys.turns(session_id), 0, -1)]

    def calls(self, session_id: str) -> list[TrackedCall]:
        """Every tracked call of the session, oldest batch first, in call order."""
        check_session_id(session_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(self.keys.calls(session_id))
        pipe.hgetall(self.keys.results(session_id))
        raw_calls, raw_results = pipe.execute()
        calls = [merge_outcome(v, raw_results.get(k)) for k, v in raw_calls.items()]
        return sorted(calls, key=lambda c: (c.batch, c.position))

    # -- steps -------------------------------------------------------------------------------
    def begin_step(self, session_id: str, version: int, owner: str, request: str = "") -> tuple[str, Loaded | str]:
        """Take the session's lease for a step at `version` and read what the step needs.

        Returns ("ok", Loaded) or a refusal: ("stale", current version), ("busy", holder),
        ("ended", status) or ("missing", "")."""
        check_session_id(session_id)
        lease_ms = int(self.settings.lease_seconds * 1000)
        seen = self._turn_cache.get(session_id)
        res = self._run("begin_step", session_id, [version, owner, lease_ms, request, len(seen.turns) if seen else 0])
        if res[0] == "ok":
            loaded = self._loaded(session_id, res[1], seen)
            loaded.redis_now = int(res[2]) / 1000
            return "ok", loaded
        return res[0], (res[1] if len(res) > 1 else "")

    def renew_lease(self, key: str, owner: str) -> bool:
        """Extend a lease (a session's step lease or a call's) if `owner` still holds it."""
        lease_ms = int(self.settings.lease_seconds * 1000)
        return bool(self.scripts.run("lease_renew", [key], [owner, lease_ms]))

    def commit(
        self,
        session_id: str,
        header: SessionHeader,
        owner: str,
        *,
        kind: str,
        new_turns: list[UserTurn | LlmTurn],
        calls: list[TrackedCall],
        head: str | None,
        state: State,
        status: Status,
        response: str | None,
        error: ErrorInfo | None,
        usage: Usage,
        events: list[tuple[str, dict[str, Any]]],
        steps_inc: int,
        inbox_taken: int = 0,
        request: str = "",
        now: float | None = None,
    ) -> tuple[str, int, bool]:
        """Commit a step at `header.version`; returns ("ok", new version, whether the next step is owed)
        or (refusal, 0, False)."""
        sid = session_id
        owe = status == Status.ACTIVE and state in (State.READY, State.TOOLS)
        pending = [[c.field, int(c.created_at * 1000)] for c in calls if not c.state.final]
        dispatched = [c.field for c in calls if c.state == CallState.RUNNING]
        tokens = [c for c in calls if c.state == CallState.DEFERRED and c.token]
        token_keys = tuple(self.keys.token(sid, parse_token(c.token)[1]) for c in tokens if c.token)
        control = {
            "n_turns": len(new_turns),
            "n_calls": len(calls),
            "kind": kind,
            "head": head or "",
            "state": state.value,
            "status": status.value,
            "response": json.dumps(response),
            "error": error.model_dump_json() if error else "",
            # Zero fields left out: a hash whose values stay under 64 bytes is stored compactly.
            "usage": (header.usage + usage).model_dump_json(exclude_defaults=True),
            "steps_inc": steps_inc,
            "owe": owe,
            "batch": calls[0].batch if calls else -1,
            "batch_size": len(calls),
            "pending": pending,
            "dispatched": dispatched,
            "tokens": [
                [
                    c.field,
                    int((c.expires_at or 0) * 1000),
                    c.call_id,
                    c.tool,
                    c.digest(),
                    c.reason or "",
                    str(c.meta.get("child") or ""),
                ]
                for c in tokens
            ],
            "events": [[k, json.dumps(d, ensure_ascii=False)] for k, d in events],
            "request": request,
            "inbox_taken": inbox_taken,
        }
        turn_jsons = [t.model_dump_json(exclude_none=True) for t in new_turns]
        # Sessions stored before digests keep none (their count is checked instead).
        digest = turn_digest(header.turns_digest, turn_jsons) if header.turns_digest else ""
        control["turns_digest"] = digest
        args: list[Any] = [header.version, owner, json.dumps(control, ensure_ascii=False), *turn_jsons]
        for c in calls:
            args.extend((c.field, c.model_dump_json(exclude_defaults=True)))
        res = self._run("commit_step", sid, args, extra_keys=token_keys, now=now)
        if res[0] == "ok":
            entry = self._turn_cache.get(sid)
            if entry is not None and len(entry.turns) == header.turn_count and entry.digest == header.turns_digest:
                self._remember(sid, _Transcript([*entry.turns, *new_turns], digest, int(res[1])))
            return "ok", int(res[1]), bool(res[2])
        return res[0], 0, False

    def end_step(self, session_id: str, owner: str, request: str, reason: str, keep_owed: bool = False) -> None:
        self._run("end_step", session_id, [owner, request, reason, "1" if keep_owed else "0"])

    def fail_step(self, session_id: str, version: int, error: ErrorInfo, owner: str) -> bool:
        res = self._run("fail_step", session_id, [version, error.model_dump_json(), owner])
        return bool(res[0] == "ok")

    # -- journal -----------------------------------------------------------------------------
    def journal_get(self, session_id: str, field: str) -> str | None:
        return cast("str | None", self.client.hget(self.keys.journal(session_id), field))

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

    # -- calls and tokens --------------------------------------------------------------------
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
        raise err(_token_message(status, token), **details)

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

    def token_info(self, token: str) -> dict[str, str]:
        sid, secret = parse_token(token)
        data = cast("dict[str, str]", self.client.hgetall(self.keys.token(sid, secret)))
        if not data:
            raise UnknownToken(_token_message("unknown", token), token=token)
        return data

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
            return Finished(status=str(res[0]))
        return Finished(status="ok", remaining=int(res[1]), woken=bool(res[2]), version=int(res[3]))

    def due_deadlines(self, now: float, limit: int = 100) -> list[tuple[str, str]]:
        members = cast(
            "list[str]", self.client.zrangebyscore(self.keys.deadlines, "-inf", int(now * 1000), start=0, num=limit)
        )
        # Members are written "<session id> <field>" (store/lua/): each splits in two.
        return [cast("tuple[str, str]", tuple(m.split(" ", 1))) for m in members]

    # -- drive -------------------------------------------------------------------------------
    def set_drive(self, session_id: str, drive: str) -> tuple[int, bool]:
        """Pause ("manual") or resume ("auto"); returns (version, whether a step is now owed)."""
        check_session_id(session_id)
        h = self.header(session_id)
        res = self._run("set_drive", session_id, [drive, self.agent(h.agent_hash).max_steps])
        if res[0] == "missing":
            raise UnknownSession(f"unknown session {session_id!r}", session_id=session_id)
        if res[0] == "ended":
            raise SessionNotAdvanceable(
                f"session {session_id} is {res[1]}: it cannot be resumed or paused",
                session_id=session_id,
                status=res[1],
            )
        return int(res[1]), bool(res[2])

    def send_message(self, session_id: str, query: UserQuery) -> tuple[int, int]:
        """Queue a user message for the session's next model call (a completed session becomes
        ready again); returns (version, messages now waiting)."""
        check_session_id(session_id)
        limit = self.settings.max_queued_messages
        res = self._run("send_message", session_id, [query.model_dump_json(exclude_defaults=True), limit])
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
        return int(res[1]), int(res[2])

    def prepare_step(self, session_id: str) -> int:
        """Make a session steppable (a failed one becomes active); returns its version."""
        h = self.header(session_id)
        res = self._run("step_through", session_id, [self.agent(h.agent_hash).max_steps])
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

    def expire_due(self, now: float | None = None) -> list[tuple[str, Finished]]:
        """Expire every deferred call whose deadline has passed (what the worker sweeper does);
        returns (session id, what expiring did) for each."""
        now = self.server_time() if now is None else now
        return [(sid, self.expire_call(sid, field, now=now)) for sid, field in self.due_deadlines(now)]

    def live_workers(self, within: float = 15.0) -> list[dict[str, Any]]:
        now = self.server_time()  # heartbeats are stamped with Redis's clock (tasks/services.py)
        out = []
        for name, raw in self.client.hgetall(self.keys.workers).items():
            try:
                beat = json.loads(raw)
            except json.JSONDecodeError:
                continue
            if now - float(beat.get("at", 0)) <= within:
                out.append({"name": name, **beat})
        return out

    def sweep_owed(self, candidates: list[tuple[str, bool]], now: float) -> list[Swept]:
        """Settle outbox entries atomically, each (session id, whether a step no worker picked up
        counts as lost); one round trip. See `sweep_owed.lua`."""
        pipe = self.client.pipeline(transaction=False)
        for sid, lost in candidates:
            self._run("sweep_owed", sid, ["1" if lost else "0"], now=now, pipe=pipe)
        return [
            Swept(sid, res[0], version=int(res[1]) if res[0] == "republish" else 0)
            for (sid, _), res in zip(candidates, pipe.execute(), strict=True)
        ]

    def sweep_dispatched(self, candidates: list[tuple[str, str, bool]], now: float) -> list[Swept]:
        """Settle dispatched calls atomically, each (session id, field, whether a call no worker
        started counts as lost); one round trip. See `sweep_dispatched.lua`."""
        pipe = self.client.pipeline(transaction=False)
        k = self.keys
        for sid, field, lost in candidates:
            extra = (k.call_lease(sid, field), k.call_started(sid, field))
            self._run("sweep_dispatched", sid, [field, "1" if lost else "0"], extra, now=now, pipe=pipe)
        return [
            Swept(
                sid,
                res[0],
                field=field,
                call=TrackedCall.model_validate_json(res[1]) if res[0] == "republish" else None,
            )
            for (sid, field, _), res in zip(candidates, pipe.execute(), strict=True)
        ]

    def check_eviction(self) -> None:
        """Refuse a Redis that may evict keys (session state would vanish silently under memory
        pressure), unless AGENTS_ALLOW_EVICTION=1. A server without a memory limit never evicts."""
        if self.settings.allow_eviction:
            return
        try:
            cfg = self.client.config_get("maxmemory*")
        except redis.ResponseError:
            return  # CONFIG is disabled (managed Redis): nothing to check
        policy = cfg.get("maxmemory-policy", "noeviction")
        if policy != "noeviction" and int(cfg.get("maxmemory", "0") or 0) > 0:
            raise RedisUnavailable(
                f"this Redis may evict keys (maxmemory-policy {policy}): session state and completions could be "
                "lost. Set `maxmemory-policy noeviction`, or AGENTS_ALLOW_EVICTION=1 to run anyway."
            )

    def lock(self, key: str, seconds: float) -> Lock:
        """A lock on `key` (`keys.lock(name)`, a call's lease...) that expires after `seconds`
        unless extended; released atomically, only by the token that holds it."""
        return Lock(self.client, key, timeout=seconds, thread_local=False)

    def acquire(self, lock: Lock, token: str) -> bool:
        """Take `lock` for `token` now, without waiting. The client retries a SET whose reply was
        lost: that retry finds the lock already `token`'s, which is taking it, not a refusal."""
        if lock.acquire(blocking=False, token=token):
            return True
        if self.client.get(lock.name) != token:
            return False
        lock.local.token = token.encode()  # what `acquire` records on success (the client encodes UTF-8)
        return True

    def owed(self, older_than: float, limit: int = 200) -> list[str]:
        return list(
            cast(
                "list[str]",
                self.client.zrangebyscore(self.keys.owed, "-inf", int(older_than * 1000), start=0, num=limit),
            )
        )

    def touch_owed(self, session_id: str, now: float) -> None:
        self.client.zadd(self.keys.owed, {session_id: int(now * 1000)}, xx=True)

    # -- views -------------------------------------------------------------------------------
    def pending_calls(self, session_id: str) -> list[TrackedCall]:
        return [call for call, _ in self._pending_rows(session_id)]

    def _pending_rows(self, session_id: str) -> list[tuple[TrackedCall, bool]]:
        """The session's unfinished calls in the model's order, each with whether a worker (or
        the CLI) has started running it."""
        check_session_id(session_id)
        fields = sorted(cast("set[str]", self.client.smembers(self.keys.pending(session_id))))
        if not fields:
            if not self.client.exists(self.keys.meta(session_id)):
                raise UnknownSession(f"unknown session {session_id!r}", session_id=session_id)
            return []
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(self.keys.calls(session_id), fields)
        pipe.hmget(self.keys.results(session_id), fields)
        pipe.mget([self.keys.call_started(session_id, f) for f in fields])
        raw_calls, raw_results, started = pipe.execute()
        return _unfinished(raw_calls, raw_results, started)

    def live_state(self, headers: list[SessionHeader]) -> list[Live]:
        """For each session: its unfinished calls, whether a step holds its lease, and its child
        sessions; two pipelined round trips for any number of sessions."""
        k = self.keys
        pipe = self.client.pipeline(transaction=False)
        for h in headers:
            pipe.exists(k.lease(h.session_id))
            pipe.smembers(k.pending(h.session_id))
            pipe.smembers(k.children(h.session_id))
        first = pipe.execute()
        leased = [bool(x) for x in first[0::3]]
        fields = [sorted(x) for x in first[1::3]]
        children = [sorted(x) for x in first[2::3]]
        pipe = self.client.pipeline(transaction=False)
        for h, fs in zip(headers, fields, strict=True):
            if fs:
                pipe.hmget(k.calls(h.session_id), fs)
                pipe.hmget(k.results(h.session_id), fs)
                pipe.mget([k.call_started(h.session_id, f) for f in fs])
        second = iter(pipe.execute())
        out: list[Live] = []
        for h, fs, lease, kids in zip(headers, fields, leased, children, strict=True):
            pending: list[PendingCall] = []
            if fs:
                rows = _unfinished(next(second), next(second), next(second))
                pending = [pending_view(h.session_id, c, started) for c, started in rows]
            out.append(Live(pending, lease, kids))
        return out

    def pending_view(self, session_id: str | None = None, limit: int = 1000) -> list[PendingCall]:
        """Unfinished calls of one session, or of all sessions oldest first (never a scan)."""
        if session_id is not None:
            return [pending_view(session_id, c, started) for c, started in self._pending_rows(session_id)]
        members = cast("list[str]", self.client.zrange(self.keys.pending_all, 0, limit - 1))
        pairs = [m.split(" ", 1) for m in members]
        if not pairs:
            return []
        pipe = self.client.pipeline(transaction=False)
        for sid, field in pairs:
            pipe.hget(self.keys.calls(sid), field)
            pipe.hget(self.keys.results(sid), field)
        pipe.mget([self.keys.call_started(sid, field) for sid, field in pairs])
        raw = pipe.execute()
        started = raw.pop()
        out: list[tuple[int, int, PendingCall]] = []
        for i, (sid, _field) in enumerate(pairs):
            if raw[2 * i]:
                call = merge_outcome(raw[2 * i], raw[2 * i + 1])
                if not call.state.final:
                    out.append((call.batch, call.position, pending_view(sid, call, started[i] is not None)))
        # Calls made by one step share a creation time: keep them in the model's call order.
        out.sort(key=lambda row: (row[2].created_at, row[2].session_id, row[0], row[1]))
        return [row[2] for row in out]

    def list_sessions(self, state: str | None = None, limit: int = 50) -> list[SessionHeader]:
        index = self.keys.state_index(state) if state else self.keys.sessions
        ids = cast("list[str]", self.client.zrevrange(index, 0, limit - 1))
        pipe = self.client.pipeline(transaction=False)
        for sid in ids:
            pipe.hgetall(self.keys.meta(sid))
        return [header_from_hash(d) for d in pipe.execute() if d]

    # -- events ------------------------------------------------------------------------------
    def last_event_id(self, session_id: str) -> str:
        last = cast("_Entries", self.client.xrevrange(self.keys.events(session_id), count=1))
        return last[0][0] if last else "0-0"

    def read_events(
        self, session_id: str, after: str = "0-0", block_ms: int | None = None, count: int = 500
    ) -> list[dict[str, Any]]:
        key = self.keys.events(session_id)
        raw: _Entries
        if block_ms is None:
            raw = cast("_Entries", self.client.xrange(key, min=f"({after}" if after != "0-0" else "-", count=count))
        else:
            # RESP2: [[stream, entries]] for the one stream asked, or nothing once the block ran out.
            res = cast("list[tuple[str, _Entries]]", self.client.xread({key: after}, block=block_ms, count=count))
            raw = res[0][1] if res else []
        return [event_from_entry(eid, fields) for eid, fields in raw]

    def follow_events(self, session_id: str, after: str = "0-0", block_ms: int = 1000) -> Iterator[dict[str, Any]]:
        while True:
            events = self.read_events(session_id, after, block_ms=block_ms)
            for e in events:
                after = e["id"]
                yield e


def event_from_entry(eid: str, fields: dict[str, str]) -> dict[str, Any]:
    data = json.loads(fields.get("data") or "{}")
    return {
        "id": eid,
        "type": fields.get("type", ""),
        "at": float(fields.get("at", 0)),
        "version": int(fields.get("version", 0)),
        **data,
    }


def _unfinished(
    raw_calls: list[str | None], raw_results: list[str | None], started: list[str | None]
) -> list[tuple[TrackedCall, bool]]:
    rows = [
        (merge_outcome(c, r), s is not None)
        for c, r, s in zip(raw_calls, raw_results, started, strict=True)
        if c is not None
    ]
    return sorted((row for row in rows if not row[0].state.final), key=lambda row: (row[0].batch, row[0].position))


def pending_view(session_id: str, call: TrackedCall, started: bool = True) -> PendingCall:
    """`started`: a worker (or the CLI) has begun running a dispatched call; until then its
    state reads `queued`."""
    state = call.state.value
    if call.state == CallState.RUNNING and not started:
        state = "queued"
    return PendingCall(
        session_id=session_id,
        call_id=call.call_id,
        tool=call.tool,
        arguments=call.arguments,
        disposition=call.disposition,
        reason=call.reason,
        state=state,
        token=call.token if call.state == CallState.DEFERRED else None,
        created_at=call.created_at,
        expires_at=call.expires_at,
    )


def _token_message(status: str, token: str) -> str:
    short = token if len(token) <= 80 else token[:77] + "..."
    return {
        "unknown": f"unknown token {short!r}",
        "completed": f"token {short!r} was already completed",
        "expired": f"token {short!r} expired: its deadline passed and the model was told no result came",
        "cancelled": f"token {short!r} was cancelled with its session",
    }.get(status, f"token {short!r} cannot be completed ({status})")
