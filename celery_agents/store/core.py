"""The part of `Store` every other part builds on: the client, settings, keys, scripts, the turn
cache, the header read, unfinished calls and locks."""

from __future__ import annotations

import json
import threading
import uuid
from collections import OrderedDict
from typing import Any, cast

import redis
from redis.lock import Lock

from celery_agents.config import Settings
from celery_agents.errors import RedisUnavailable, UnknownSession, UntrustedSpec
from celery_agents.model import AgentSpec, SessionHeader, TrackedCall
from celery_agents.store.codec import unfinished_rows
from celery_agents.store.header import header_from_hash
from celery_agents.store.ids import check_session_id
from celery_agents.store.keys import Keys
from celery_agents.store.records import Transcript
from celery_agents.store.scripts import Scripts
from celery_agents.store.signing import spec_verifies


class StoreCore:
    """The Redis client, settings, keys and scripts every part of the store shares, and the reads they all need."""

    def __init__(self, client: redis.Redis, settings: Settings | None = None) -> None:
        self.client = client
        self.settings = settings or Settings()
        self.keys = Keys(self.settings.prefix)
        self.scripts = Scripts(client)
        self._agents: dict[str, AgentSpec] = {}
        self._turn_cache: OrderedDict[str, Transcript] = OrderedDict()
        self._turn_lock = threading.Lock()

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
    ) -> Any:
        # One id per call: the client's retries after a lost reply resend it, and the script
        # answers them with the first reply (`once` in store/lua/_lib.lua).
        keys = self.keys.script_keys(sid, request_id or uuid.uuid4().hex, *extra_keys)
        try:
            # No `now`: the script reads Redis's clock (durable times never come from a worker's),
            # with TIME or (`clock="event"`) from the stream id of the first event it writes.
            stamp = clock if now is None else repr(now)
            return self.scripts.run(name, keys, [stamp, self.settings.events_maxlen, sid, *args], client=pipe)
        except redis.ConnectionError as exc:
            raise RedisUnavailable(f"cannot reach Redis: {exc}") from exc

    def ping(self) -> None:
        try:
            self.client.ping()
        except redis.ConnectionError as exc:
            raise RedisUnavailable(f"cannot reach Redis: {exc}") from exc

    def server_time(self) -> float:
        """Redis's clock (seconds): durable cutoffs are measured against it, not a host's clock."""
        sec, usec = self.client.time()
        return sec + usec / 1_000_000

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

    def header(self, session_id: str) -> SessionHeader:
        check_session_id(session_id)
        try:
            data = cast("dict[str, str]", self.client.hgetall(self.keys.meta(session_id)))
        except redis.ConnectionError as exc:
            raise RedisUnavailable(f"cannot reach Redis: {exc}") from exc
        if not data:
            raise UnknownSession(f"unknown session {session_id!r}", session_id=session_id)
        return header_from_hash(data)

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
        return unfinished_rows(raw_calls, raw_results, started)
