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

from celery_agents.config import Settings
from celery_agents.store import Keys
from celery_agents.store.gauges import QueueLists
from celery_agents.tasks.config import PRIORITY_STEPS, PUBLISHED_MS, REDIS_SCHEMES, celery_config

log = logging.getLogger(__name__)


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

    def __init__(self, settings: Settings, state: QueueLists) -> None:
        self.settings = settings
        self.state = state
        self._connection: Any = None
        self._broker_redis: QueueLists | None = None

    def heads(self, names: Iterable[str]) -> dict[str, QueueHead]:
        names = list(names)
        broker = self.settings.broker_url
        try:
            if not broker:
                return self._redis_heads(self.state, names)
            if broker.split("://", 1)[0] in REDIS_SCHEMES:
                if self._broker_redis is None:
                    url = "unix://" + broker.split("://", 1)[1] if broker.startswith("redis+socket://") else broker
                    self._broker_redis = QueueLists.at(url)
                return self._redis_heads(self._broker_redis, names)
            return self._broker_heads(names)
        except Exception as exc:  # an unreachable broker: unknown, so nothing counts as lost early
            if not broker:
                raise
            log.warning("cannot read the broker's queues: %s", exc)
            self.close()
            return {n: QueueHead(None) for n in names}

    def _redis_heads(self, lists_of: QueueLists, names: list[str]) -> dict[str, QueueHead]:
        prefix = Keys(self.settings.prefix).celery_prefix
        lists = {name: redis_lists(prefix, name) for name in names}
        rows = iter(lists_of.heads([k for keys in lists.values() for k in keys]))
        heads = {}
        for name, keys in lists.items():
            read = [next(rows) for _ in keys]
            heads[name] = merged_head([QueueHead(depth, oldest_published_ms(oldest)) for depth, oldest in read])
        return heads

    def _broker_heads(self, names: list[str]) -> dict[str, QueueHead]:
        from kombu.connection import Connection
        from kombu.exceptions import ChannelError

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


#: kombu's Redis transport: between a queue's name and the priority of its list
PRIORITY_SEP = "\x06\x16"


def redis_lists(prefix: str, name: str) -> list[str]:
    """The Redis lists of queue `name` under the broker's key prefix. `steps` has one per message
    priority (tasks/config.py `PRIORITY_STEPS`: the bare name is priority 0, taken first); the
    other queues publish without one, into the bare name."""
    if name != "steps":
        return [f"{prefix}{name}"]
    return [f"{prefix}{name}" + (f"{PRIORITY_SEP}{p}" if p else "") for p in PRIORITY_STEPS]


def merged_head(heads: list[QueueHead]) -> QueueHead:
    """One queue's head from the heads of its lists: every message waiting in any of them, and
    the oldest publish time of their oldest messages (each list is first in, first out; a
    message waiting is in one of them), unknown when one of them has messages of no known time."""
    depth = sum(h.depth or 0 for h in heads)
    waiting = [h for h in heads if h.depth]
    if not waiting or any(h.published_ms is None for h in waiting):
        return QueueHead(depth)
    return QueueHead(depth, min(h.published_ms for h in waiting if h.published_ms is not None))


def _not_found(exc: BaseException) -> bool:
    code = getattr(exc, "reply_code", None) or getattr(exc, "code", None)
    return code == 404 or str(code) == "404" or "NOT_FOUND" in str(exc)
