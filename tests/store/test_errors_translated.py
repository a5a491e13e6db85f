"""redis-py's errors are translated once, by the store's client: above the store (the runtime, the
CLI, the HTTP API) they are the project's `redis_unavailable`, while the store's own handling of
redis-py's classes (NOGROUP, NOSCRIPT, a WATCH that lost) goes on working."""

from __future__ import annotations

import dataclasses
import secrets
import socket

import pytest
import redis

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.errors import AgentsError, RedisRefused, RedisUnavailable
from celery_agents.store import Store, client_for_url


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_redis_is_the_projects_error_with_its_code(settings: Settings) -> None:
    url = f"redis://127.0.0.1:{_closed_port()}/0"
    with (
        Client(dataclasses.replace(settings, redis_url=url), inline=False) as client,
        pytest.raises(RedisUnavailable) as caught,
    ):
        client.list()
    assert caught.value.to_json()["error"]["code"] == "redis_unavailable"
    assert "cannot reach Redis" in caught.value.message
    assert isinstance(caught.value, redis.ConnectionError), "the store's outage handling still sees redis-py's class"


def test_an_error_reply_is_refused_not_unreachable(store: Store) -> None:
    key = f"{store.settings.prefix}:wrongtype"
    store.client.set(key, "x")
    try:
        with pytest.raises(RedisRefused) as caught:
            store.client.hset(key, "f", "v")
        assert not isinstance(caught.value, RedisUnavailable), "an error reply is no outage: no retry waits for it"
        assert isinstance(caught.value, redis.ResponseError)
        assert "WRONGTYPE" in caught.value.message and caught.value.code == "redis_unavailable"
        pipe = store.client.pipeline()
        pipe.get(key)
        pipe.hset(key, "f", "v")
        with pytest.raises(RedisRefused):
            pipe.execute()
    finally:
        store.client.delete(key)


def test_redis_pys_own_recovery_still_works_through_the_translation(store: Store) -> None:
    # A script Redis has never seen: EVALSHA answers NOSCRIPT, and redis-py's Script loads it.
    script = store.client.register_script(f"return 7 -- {secrets.token_hex(8)}")
    assert not store.client.script_exists(script.sha)[0]
    assert script() == 7
    key = f"{store.settings.prefix}:watched"
    with store.client.pipeline() as pipe:
        pipe.watch(key)
        store.client.set(key, "changed")
        pipe.multi()
        pipe.set(key, "mine")
        with pytest.raises(redis.WatchError):
            pipe.execute()
    store.client.delete(key)


def test_every_state_client_translates() -> None:
    client = client_for_url(f"redis://127.0.0.1:{_closed_port()}/0")
    with pytest.raises(AgentsError):
        client.ping()
    client.close()
