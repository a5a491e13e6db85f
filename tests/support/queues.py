"""What waits in a queue on the Redis broker: kombu keeps one list per message priority for `steps`
(tasks/queues.py `redis_lists`), the bare name for the others."""

from __future__ import annotations

from typing import cast

import redis

from celery_agents.tasks.queues import redis_lists


def depth(client: redis.Redis, celery_prefix: str, queue: str = "steps") -> int:
    """Messages waiting in `queue`, every priority's list together."""
    return sum(int(client.llen(key)) for key in redis_lists(celery_prefix, queue))


def messages(client: redis.Redis, celery_prefix: str, queue: str = "steps") -> list[str | bytes]:
    """The raw messages waiting in `queue`, in the order a worker takes them (highest priority
    first, oldest first within a priority)."""
    out: list[str | bytes] = []
    for key in redis_lists(celery_prefix, queue):
        out += list(reversed(cast("list[str | bytes]", client.lrange(key, 0, -1))))
    return out
