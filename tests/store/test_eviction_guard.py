"""A Redis that may evict keys is refused (sessions would vanish under memory pressure)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_agents.config import Settings
from celery_agents.errors import RedisUnavailable
from celery_agents.store import Store, client_for_url
from tests.support.redis_server import RedisServer


@pytest.fixture
def evicting_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop(kill=True)


def test_an_evicting_redis_is_refused_unless_allowed(
    evicting_redis: RedisServer, monkeypatch: pytest.MonkeyPatch, prefix: str
) -> None:
    client = client_for_url(evicting_redis.url)
    store = Store(client, Settings(redis_url=evicting_redis.url, prefix=prefix))
    store.check_eviction()  # noeviction: fine
    client.config_set("maxmemory-policy", "allkeys-lru")
    store.check_eviction()  # no memory limit: nothing is ever evicted
    client.config_set("maxmemory", "100mb")
    with pytest.raises(RedisUnavailable, match="allkeys-lru"):
        store.check_eviction()
    monkeypatch.setenv("AGENTS_ALLOW_EVICTION", "1")
    Store(client, Settings.from_env(redis_url=evicting_redis.url, prefix=prefix)).check_eviction()
    client.close()
