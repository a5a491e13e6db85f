"""What waits in the work queues (`steps`, `tools`, `isolated`), whatever the broker.

With a Redis broker (the state Redis by default, or another named by `AGENTS_BROKER_URL`) a
queue is a list under `<prefix>:celery:`: its length and its oldest message (which carries its
publish time, see `PUBLISHED_MS`) are read in one pipeline. With another kind of broker
(RabbitMQ) the depth comes from a passive queue declaration through kombu, and the oldest
message's publish time is unknown. The sweeper uses this to tell a message still waiting from one that was lost; doctor
shows the depths.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis

from celery_agents.config import Settings
from celery_agents.store import Keys, client_for_url

log = logging.getLogger(__name__)

#: a message header: when it was published (ms since the epoch, the publisher's clock)
PUBLISHED_MS = "agents_published_ms"


@dataclass(frozen=True)
class QueueHead:
    """How many messages wait in a queue (None: unknown) and when the oldest was published."""

    depth: int | None
    published_ms: int | None = None

    def cannot_hold(self, committed_ms: float, margin_ms: float) -> bool:
        """Whether a message published right after `committed_ms` cannot still be waiting here:
        the queue is empty, or its oldest message was published later (queues are first in,
        first out). `margin_ms` absorbs publishing delay and clock skew between machines."""
        if self.depth == 0:
            return True
        return self.published_ms is not None and self.published_ms > committed_ms + margin_ms


def oldest_published_ms(raw_message: str | None) -> int | None:
    """When a message of the Redis transport (as `LINDEX <queue> -1` returns it) was published."""
    if not raw_message:
        return None
    try:
        value = json.loads(raw_message).get("headers", {}).get(PUBLISHED_MS)
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


class QueueProbe:
    """Reads the queues' heads; keeps its broker connection between calls (the sweeper's)."""

    def __init__(self, settings: Settings, state: redis.Redis) -> None:
        self.settings = settings
        self.state = state
        self._connection: Any = None
        self._broker_redis: redis.Redis | None = None

    def heads(self, names: Iterable[str]) -> dict[str, QueueHead]:
        names = list(names)
        broker = self.settings.broker_url
        try:
            if not broker:
                return self._redis_heads(self.state, names)
            if broker.split("://", 1)[0] in REDIS_SCHEMES:
                if self._broker_redis is None:
                    url = "unix://" + broker.split("://", 1)[1] if broker.startswith("redis+socket://") else broker
                    self._broker_redis = client_for_url(url)
                return self._redis_heads(self._broker_redis, names)
            return self._broker_heads(names)
        except Exception as exc:  # an unreachable broker: unknown, so nothing counts as lost early
            if not broker:
                raise
            log.warning("cannot read the broker's queues: %s", exc)
            self.close()
            return {n: QueueHead(None) for n in names}

    def _redis_heads(self, client: redis.Redis, names: list[str]) -> dict[str, QueueHead]:
        prefix = Keys(self.settings.prefix).celery_prefix
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.llen(f"{prefix}{name}")
            pipe.lindex(f"{prefix}{name}", -1)
        rows = pipe.execute()
        return {name: QueueHead(int(rows[2 * i]), oldest_published_ms(rows[2 * i + 1])) for i, name in enumerate(names)}

    def _broker_heads(self, names: list[str]) -> dict[str, QueueHead]:
        from kombu.connection import Connection
        from kombu.exceptions import ChannelError

        from celery_agents.tasks.config import celery_config

        if self._connection is None:
            conf = celery_config(self.settings)
            self._connection = Connection(  # type: ignore[no-untyped-call]  # kombu is untyped
                conf["broker_url"], transport_options=conf["broker_transport_options"], connect_timeout=5
            )
        out: dict[str, QueueHead] = {}
        for name in names:
            channel = self._connection.channel()
            try:
                _, depth, _ = channel.queue_declare(queue=name, passive=True)
                out[name] = QueueHead(int(depth))
            except ChannelError as exc:
                # Not declared yet (no worker or publisher has used it): nothing waits. Anything
                # else (access refused...) leaves the depth unknown.
                out[name] = QueueHead(0 if _not_found(exc) else None)
            finally:
                with contextlib.suppress(Exception):
                    channel.close()
        return out

    def close(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(Exception):
                self._connection.release()
            self._connection = None
        if self._broker_redis is not None:
            with contextlib.suppress(Exception):
                self._broker_redis.close()
            self._broker_redis = None


#: broker URL schemes of kombu's Redis transport: its queues are lists, read directly
REDIS_SCHEMES = {"redis", "rediss", "redis+socket"}


def _not_found(exc: BaseException) -> bool:
    code = getattr(exc, "reply_code", None) or getattr(exc, "code", None)
    return code == 404 or str(code) == "404" or "NOT_FOUND" in str(exc)
