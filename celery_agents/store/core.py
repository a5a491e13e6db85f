"""The part of `Store` every other part builds on: the client, settings, keys, scripts, the turn
cache, the header read, unfinished calls and locks."""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Self, TypeVar, cast

import redis
from redis.lock import Lock

from celery_agents.config import Settings
from celery_agents.errors import IncompatibleData, RedisUnavailable, UnknownSession, UntrustedSpec
from celery_agents.model import AgentSpec, SessionHeader, TrackedCall
from celery_agents.store.codec import unfinished_rows
from celery_agents.store.connection import sentinel_verdict, translated
from celery_agents.store.header import header_from_hash
from celery_agents.store.ids import check_session_id
from celery_agents.store.keys import Keys
from celery_agents.store.outage import UNREACHABLE, OutageWatch
from celery_agents.store.records import Transcript
from celery_agents.store.replication import ReplicaAcks
from celery_agents.store.scripts import Scripts
from celery_agents.store.signing import spec_verifies

log = logging.getLogger("celery_agents.store")


class _Unreached:
    """In `StoreCore.in_reach`'s replies: this command's node could not be reached."""

    def __repr__(self) -> str:
        return "UNREACHED"


UNREACHED: Any = _Unreached()

T = TypeVar("T")


#: The layout of what celery-agents stores under its prefix (keys, header fields, the JSON of
#: turns, calls and events), kept in `<prefix>:format`. A release that changes the layout raises
#: it; 0.x releases do not migrate older data (docs/architecture.md, "Stored format").
STORED_FORMAT = 4


class StoreCore:
    """The Redis client, settings, keys and scripts every part of the store shares, and the reads they all need."""

    def __init__(self, client: redis.Redis, settings: Settings | None = None, outage_seconds: float = 0.0) -> None:
        """`outage_seconds`: how long calls wait out an unreachable Redis (a worker's store:
        AGENTS_REDIS_OUTAGE_SECONDS); 0 raises `RedisUnavailable` at the first failure."""
        self.client = client
        self.settings = settings or Settings()
        self.outage = OutageWatch(outage_seconds)
        self.keys = Keys(self.settings.prefix, self.settings.shards)
        self.acks = ReplicaAcks(self.settings.replicas_to_ack, sentinels=sentinel_verdict(client))
        self.scripts = Scripts(client, self.acks)
        self._agents: dict[str, AgentSpec] = {}
        self._turn_cache: OrderedDict[str, Transcript] = OrderedDict()
        self._turn_lock = threading.Lock()
        #: held by the thread reading the fleet's limits again (store/admission.py)
        self._fleet_refresh = threading.Lock()

    def _run(
        self,
        name: str,
        sid: str,
        args: list[Any],
        extra_keys: tuple[str, ...] = (),
        now: float | None = None,
        pipe: Any = None,
        request_id: str = "",
        clock: str = "",
        effect: bool = False,
    ) -> Any:
        # One id per call: the client's retries after a lost reply resend it, and the script
        # answers them with the first reply (`once` in store/lua/_lib.lua).
        keys = self.scripts.session_keys(name, self.keys, sid, request_id or uuid.uuid4().hex, *extra_keys)
        # No `now`: the script reads Redis's clock (durable times never come from a worker's),
        # with TIME or (`clock="event"`) from the stream id of the first event it writes.
        stamp = clock if now is None else repr(now)
        argv = [stamp, self.settings.events_maxlen, sid, *args]
        if pipe is not None:  # queued, not sent: the pipeline's `execute` is what may fail
            return self.scripts.run(name, keys, argv, client=pipe)
        # Sent again through an outage with the same request id: the script answers with its first reply.
        if not self.acks.replicas:
            return self.through_outage(lambda: self.scripts.run(name, keys, argv), effect=effect)
        place = self.acks.begin()
        reply = self.through_outage(lambda: self.scripts.run(name, keys, argv), effect=effect)
        due = self.acks.settle(sid, place)
        if due:
            self._check_unconfirmed(due)
        return reply

    def pack_waiting(self, sid: str) -> None:
        """Pack the events of a session left waiting (pack_waiting.lua; nothing if it does not
        wait), after a write that added events to it. Only memory rides on it: a failure leaves
        the stream as it is."""
        try:
            self._run("pack_waiting", sid, [], clock="event")
        except (RedisUnavailable, redis.RedisError) as e:
            log.warning("session %s: its events stay a stream (%s)", sid, e)

    def _check_unconfirmed(self, sids: list[str]) -> None:
        """Sessions this process wrote while no replica acknowledged, now that a later write was
        acknowledged: any stored at a lower version than this process knew lost those writes (a
        failover in between): recorded rewound, and their cached turns dropped. One round trip."""
        with self._turn_lock:
            seen = {sid: self._turn_cache[sid] for sid in sids if sid in self._turn_cache}
        if not seen:
            return
        pipe = self.client.pipeline(transaction=False)
        for sid in seen:
            pipe.hgetall(self.keys.meta(sid))
        try:  # the write that asked succeeded: whatever happens here is not its failure
            rows = cast("list[dict[str, str]]", pipe.execute())
            for (sid, transcript), data in zip(seen.items(), rows, strict=True):
                if data and (stored := header_from_hash(data, sid)).version < transcript.version:
                    with self._turn_lock:
                        self._turn_cache.pop(sid, None)
                    self._went_back(sid, transcript, stored)
        except redis.RedisError as exc:
            log.warning("could not check %s session(s) written while no replica acknowledged: %s", len(seen), exc)

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
        self.client.hset(self.keys.for_session(session_id).rewound, session_id, json.dumps(record))

    def in_reach(self, pipe: Any) -> list[Any]:
        """`pipe`'s replies, its commands spread over several slots (the index shards, sessions of
        several shards): a command whose node is out of reach this moment (on a Cluster, its slot
        moving between primaries, its primary failing over) answers an `Unreached` in its place,
        so that the rest go on (the sweeper sweeps that part next time); when every command is out
        of reach, or one fails otherwise, it raises as `pipe.execute()` would."""
        replies = cast("list[Any]", pipe.execute(raise_on_error=False))
        failed = [r for r in replies if isinstance(r, redis.RedisError)]
        if not failed:
            return replies
        if len(failed) == len(replies) or not all(isinstance(r, UNREACHABLE) for r in failed):
            raise translated(failed[0])
        log.warning(
            "%s of %s commands could not reach their Redis node (%s): the others go on",
            len(failed),
            len(replies),
            failed[0],
        )
        return [UNREACHED if isinstance(r, redis.RedisError) else r for r in replies]

    def due(self, index: str, upto: float, limit: int) -> list[tuple[str, float]]:
        """Members of every shard's sorted set `index` (a `Keys` property: `owed`, `deadlines`...)
        scored up to `upto` (seconds; the scores are ms), with their scores, lowest first, at most
        `limit`; one round trip. A shard out of reach this moment (`in_reach`) is left for the
        next sweep."""
        cutoff = int(upto * 1000)
        pipe = self.client.pipeline(transaction=False)
        for shard in self.keys.all_shards():
            pipe.zrangebyscore(getattr(shard, index), "-inf", cutoff, start=0, num=limit, withscores=True)
        rows: list[tuple[str, float]] = [
            (str(member), float(score))
            for chunk in self.in_reach(pipe)
            if chunk is not UNREACHED
            for member, score in chunk
        ]
        return sorted(rows, key=lambda row: row[1])[:limit] if self.keys.shards > 1 else rows

    def through_outage(self, send: Callable[[], T], effect: bool = False) -> T:
        """`send()` (calls of this store's client that may be sent twice), waiting out an
        unreachable Redis for up to this store's bound (store/outage.py), then `RedisUnavailable`;
        `effect`: the record of what a tool did, which a worker waits for however long it takes."""
        return self.outage.call(send, effect)

    def at_once(self) -> Self:
        """This store, raising `RedisUnavailable` at the first failure to reach Redis: for what is
        worth one try only (letting a lease go early, a sweep that the next one repeats)."""
        quick = copy.copy(self)
        quick.outage = OutageWatch(0.0)
        return quick

    def ping(self) -> None:
        try:
            self.client.ping()
        except redis.ConnectionError as exc:
            raise RedisUnavailable(f"cannot reach Redis: {exc}") from exc

    def server_time(self) -> float:
        """Redis's clock (seconds): durable cutoffs are measured against it, not a host's clock."""
        sec, usec = self.client.time()
        return sec + usec / 1_000_000

    def agent(self, content_hash: str, session_id: str | None = None) -> AgentSpec:
        """The agent spec stored under a hash, cached in this process (specs never change). Specs
        are stored in each index shard that has a session of theirs: `session_id` names one (with
        one shard, it may be left out)."""
        spec = self._agents.get(content_hash)
        if spec is None:
            key = self.settings.spec_key
            keys = self.keys.for_session(session_id) if session_id else self.keys
            names = [keys.agent(content_hash), keys.agent_signature(content_hash)]
            raw, signature = cast("list[str | None]", self.through_outage(lambda: self.client.mget(names)))
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

    def spec_signed(self, content_hash: str, session_id: str | None = None) -> bool:
        """Whether a signature was stored beside the spec (it was stored with AGENTS_SPEC_KEY set)."""
        name = (self.keys.for_session(session_id) if session_id else self.keys).agent_signature(content_hash)
        return bool(self.through_outage(lambda: self.client.exists(name)))

    def header(self, session_id: str) -> SessionHeader:
        check_session_id(session_id)
        key = self.keys.meta(session_id)
        data = cast("dict[str, str]", self.through_outage(lambda: self.client.hgetall(key)))
        if not data:
            raise UnknownSession(f"unknown session {session_id!r}", session_id=session_id)
        return header_from_hash(data, session_id)

    def check_format(self) -> None:
        """Refuse a Redis whose data under this prefix has another stored format than this
        release's (`STORED_FORMAT`); record the format where none is (one round trip). Drops the
        index of all sessions that earlier releases kept (`Keys.old_sessions_index`)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.setnx(self.keys.format, STORED_FORMAT)
        pipe.get(self.keys.format)
        for shard in self.keys.all_shards():
            pipe.unlink(shard.old_sessions_index)
        found = pipe.execute()[1]
        if found != str(STORED_FORMAT):
            raise IncompatibleData(
                f"this Redis holds celery-agents data of format {found} under prefix {self.keys.prefix!r}; this "
                f"release reads format {STORED_FORMAT}: run the release that wrote it until its sessions end, or "
                "use another AGENTS_PREFIX (or Redis database)",
                found=found,
                format=STORED_FORMAT,
            )

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
        """Take `lock` for `token` now, without waiting for it to be free (through a moment of
        Redis away, as every call of this store that may be sent twice). The client retries a SET
        whose reply was lost: that retry finds the lock already `token`'s, which is taking it, not
        a refusal."""
        return self.through_outage(lambda: self._acquire(lock, token))

    def _acquire(self, lock: Lock, token: str) -> bool:
        if lock.acquire(blocking=False, token=token):
            return True
        if self.client.get(lock.name) != token:
            return False
        lock.local.token = token.encode()  # what `acquire` records on success (the client encodes UTF-8)
        return True

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

    def lease_holder(self, session_id: str) -> str | None:
        return cast("str | None", self.client.get(self.keys.lease(session_id)))

    def pending_calls(self, session_id: str) -> list[TrackedCall]:
        return [call for call, _ in self._pending_rows(session_id)]

    def _pending_rows(self, session_id: str) -> list[tuple[TrackedCall, bool]]:
        """The session's unfinished calls in the model's order, each with whether a worker (or
        the CLI) has started running it."""
        check_session_id(session_id)
        fields = sorted(cast("list[str]", self.client.hkeys(self.keys.pending(session_id))))
        if not fields:
            if not self.client.exists(self.keys.meta(session_id)):
                raise UnknownSession(f"unknown session {session_id!r}", session_id=session_id)
            return []
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(self.keys.calls(session_id), fields)
        pipe.hmget(self.keys.results(session_id), fields)
        pipe.mget([self.keys.call_started(session_id, f) for f in fields])
        raw_calls, raw_results, started = pipe.execute()
        return unfinished_rows(raw_calls, raw_results, started)
