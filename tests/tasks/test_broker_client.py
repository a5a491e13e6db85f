"""A worker's broker channel publishes with one Redis client, kept while the channel's pool is
the same: kombu makes a client per message it publishes, and making one (redis-py builds its
table of reply callbacks) was a fifth of a step message's publishing. A channel whose pool is
replaced gets a client of the new pool; a channel closed with its connection raises a connection
error, which kombu and Celery handle."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from kombu import Connection
from kombu.transport import redis as kombu_redis

from celery_agents.tasks import broker


@pytest.fixture
def patched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What `broker.install()` does in a worker, undone after the test."""
    monkeypatch.setattr(kombu_redis.Channel, "_brpop_read", broker._brpop_read)
    monkeypatch.setattr(kombu_redis.Channel, "_create_client", broker._create_client_if_open)
    yield


def test_a_channel_publishes_every_message_with_one_client_that_follows_its_pool(
    patched: None, redis_url: str, prefix: str
) -> None:
    options = {"global_keyprefix": f"{prefix}:celery:"}
    with Connection(redis_url, transport_options=options) as conn:
        channel = conn.default_channel
        queue = conn.SimpleQueue("jobs")
        for n in range(3):
            queue.put({"n": n})
        with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
            assert first is second, "one client for the channel's commands"
        assert [queue.get(timeout=5).payload["n"] for _ in range(3)] == [0, 1, 2]

        old = first.connection_pool
        channel._pool = None  # the pool replaced, as a channel's pools are when it reconnects
        queue.put({"n": 3})
        with channel.conn_or_acquire() as third:
            assert third is not first and third.connection_pool is channel._pool is not old
        assert queue.get(timeout=5).payload == {"n": 3}
        queue.close()
        direct = redis.Redis.from_url(redis_url)
        assert direct.llen(f"{prefix}:celery:jobs") == 0
        direct.close()

    channel.connection = None  # closed with its connection: kombu would raise AttributeError
    channel._pool = None
    with pytest.raises(redis.ConnectionError), channel.conn_or_acquire():
        pass
