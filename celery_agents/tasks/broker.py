"""Keeping a worker alive through what kombu's Redis transport does not survive (kombu 5.7.0).

- A message on a queue list that is not a kombu message (not UTF-8, not JSON, not the envelope
  kombu writes) makes `Channel._brpop_read` raise, and Celery stops the whole worker with
  "Unrecoverable error". Here such a message is set aside on `<prefix>:celery:poison` (a list,
  newest first, capped) with its queue and the reason, logged, and the worker goes on.
- When Redis closes the connection (a restart) while a task runs, Celery closes the broker
  connection; putting the running task's message back (`QoS.restore_unacked`, as the channel
  closes) and acknowledging it once the task ends (`QoS.ack`) then need a client from a channel
  whose transport has lost its connection, and kombu raises AttributeError ('NoneType' object has
  no attribute 'hostname' / 'client') instead of a connection error: Celery stops the worker
  ("Unrecoverable error"). Here such a channel raises a connection error, which kombu and Celery
  handle: a tool call's message stays in kombu's unacked set (put back after the visibility
  timeout, when its stale copy does nothing; a step's message is not acknowledged, so nothing of
  it is there), and a step or call that did not finish stays owed, so our sweeper publishes it
  again once its lease lapses.

`install()` patches these two methods; it is called once by the worker's app, never by the CLI.
The second also keeps a channel's client for the channel's publishing instead of making one per
message.
"""

from __future__ import annotations

import json
import logging
from queue import Empty
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

log = logging.getLogger("celery_agents.broker")

#: the list poison messages go to, under the broker's key prefix (`Keys.poison`)
POISON_QUEUE = "poison"
POISON_KEPT = 1000
_SHOWN = 4096


def message_problem(raw: bytes | str) -> tuple[Any, str | None]:
    """Decode one queue entry: (payload, None) when it is a message kombu can deliver, else
    (None, reason): `not_utf8`, `not_json` or `not_a_message`."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError:
        return None, "not_utf8"
    try:
        payload = loads(text)  # type: ignore[no-untyped-call]  # kombu is untyped
    except (ValueError, RecursionError):
        return None, "not_json"
    props = payload.get("properties") if isinstance(payload, dict) else None
    info = props.get("delivery_info") if isinstance(props, dict) else None
    if not isinstance(props, dict) or not props.get("delivery_tag") or not isinstance(info, dict):
        return None, "not_a_message"
    if "exchange" not in info or "routing_key" not in info:
        return None, "not_a_message"
    return payload, None


def _set_aside(channel: Any, queue: str, raw: bytes | str, reason: str) -> None:
    shown = raw.decode("utf-8", "backslashreplace") if isinstance(raw, bytes) else raw
    record = json.dumps({"queue": queue, "reason": reason, "message": shown[:_SHOWN]})
    log.error("poison message on queue %s (%s) set aside in %s: %.200s", queue, reason, POISON_QUEUE, shown)
    with channel.conn_or_acquire() as client:
        # kombu's client prefixes LPUSH with the broker's key prefix, not LTRIM.
        client.lpush(POISON_QUEUE, record)
        client.ltrim(getattr(client, "global_keyprefix", "") + POISON_QUEUE, 0, POISON_KEPT - 1)


def _brpop_read(self: Any, **options: Any) -> bool:
    """kombu 5.7.0's `Channel._brpop_read`, with the entry checked before it is delivered."""
    try:
        try:
            dest__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
        except self.connection_errors:
            self.client.connection.disconnect()
            raise
        if not dest__item:
            raise Empty()
        dest, item = dest__item
        dest = bytes_to_str(dest).rsplit(self.sep, 1)[0]  # type: ignore[no-untyped-call]
        self._queue_cycle.rotate(dest)
        payload, problem = message_problem(item)
        if problem is not None:
            _set_aside(self, dest, item, problem)
            return True
        self.connection._deliver(payload, dest)
        return True
    finally:
        self._in_poll = None
        self._flush_brpop_reauth()


_create_client = kombu_redis.Channel._create_client


def _create_client_if_open(self: Any, asynchronous: bool = False) -> Any:
    transport = self.connection
    pool = self._async_pool if asynchronous else self._pool
    if pool is None and (transport is None or transport.client is None):
        # kombu would read the server's address from the closed connection and raise
        # AttributeError. A connection error instead is what kombu and Celery handle (log,
        # reconnect); a channel that still has its pool goes on as before.
        raise redis.ConnectionError("this broker channel was closed with its connection")
    if asynchronous:
        return _create_client(self, asynchronous)  # type: ignore[no-untyped-call]  # kombu is untyped
    # kombu makes a client for every message it publishes (`conn_or_acquire`), and a redis-py 8
    # client builds its table of ~170 reply callbacks when made: a fifth of a step message's
    # publishing. A client holds no connection of its own (it takes one from the channel's pool
    # per command), so the channel's is made once and kept while that pool is the channel's.
    kept = self.__dict__.get(_KEPT_CLIENT)
    if kept is not None and kept.connection_pool is self._pool:
        return kept
    client = _create_client(self, False)  # type: ignore[no-untyped-call]  # kombu is untyped
    self.__dict__[_KEPT_CLIENT] = client
    return client


#: where a broker channel keeps its client (`_create_client_if_open`)
_KEPT_CLIENT = "_agents_client"


def install() -> None:
    kombu_redis.Channel._brpop_read = _brpop_read  # type: ignore[method-assign]
    kombu_redis.Channel._create_client = _create_client_if_open  # type: ignore[method-assign]
