"""The Celery app's configuration, and publishing steps and tool calls to its queues.

JSON only, one message taken per free process or thread, time limits below the broker's visibility
timeout, broker keys under `<prefix>:celery:`. Tool calls (`tools`, `isolated`) are acknowledged
late and requeued when a worker dies. Steps on a Redis broker are taken without acknowledgement
(`steps_unacknowledged`): what recovers a lost step message is the outbox, not the broker.
"""

from __future__ import annotations

import time
from typing import Any

from celery import Celery
from kombu.entity import Exchange, Queue

from celery_agents.config import Settings
from celery_agents.model import TrackedCall
from celery_agents.store import Keys, broker_url
from celery_agents.tasks.queues import PUBLISHED_MS, REDIS_SCHEMES

STEP_TASK = "celery_agents.step"
CALL_TASK = "celery_agents.run_call"
ISOLATED_TASK = "celery_agents.run_isolated_call"
QUEUES = ("steps", "tools", "isolated")


def steps_unacknowledged(broker: str) -> bool:
    """Whether workers take step messages from broker URL `broker` without acknowledgement: on a
    Redis broker, yes.

    Every published step is owed in Redis (`owed`, `owed_version`) until the commit that consumes
    it, so a step message taken by a worker that then dies is published again by the sweeper
    (`tasks/services.py`) from its lease (picked up: once it lapses) or from its queue (never
    picked up: once the queue cannot hold it, else after `AGENTS_LOST_GRACE`); kombu's own
    redelivery would come only after the visibility timeout. Without acknowledgement kombu's Redis
    transport spends no `MULTI ZADD HSET EXEC` to track the message and no `MULTI ZREM HDEL EXEC`
    to acknowledge it: two round trips and 8 commands per step. What a worker takes stays bounded
    by its free threads (`worker_disable_prefetch` counts reserved requests, whatever the ack
    mode). Other brokers keep acknowledgements: AMQP pushes a no-ack consumer every waiting
    message, prefetch or not, and `worker_disable_prefetch` is Redis-only."""
    return broker.split("://", 1)[0] in REDIS_SCHEMES


def task_queues(broker: str) -> tuple[Queue, ...]:
    """The three queues, each on the direct exchange of its name with its name as routing key (as
    Celery would make them), `steps` consumed without acknowledgement on a Redis broker."""
    no_ack = steps_unacknowledged(broker)
    return tuple(_queue(name, no_ack=no_ack and name == "steps") for name in QUEUES)


def _queue(name: str, no_ack: bool) -> Queue:
    exchange = Exchange(name, type="direct")  # type: ignore[no-untyped-call]  # kombu is untyped
    return Queue(name, exchange, routing_key=name, no_ack=no_ack)  # type: ignore[no-untyped-call]


def celery_config(settings: Settings) -> dict[str, Any]:
    vt = settings.visibility_timeout
    broker = broker_url(settings)
    transport = {
        "visibility_timeout": vt,
        "global_keyprefix": Keys(settings.prefix).celery_prefix,
        "socket_timeout": 30,
        "socket_connect_timeout": 5,
        "health_check_interval": 25,
        # Sweep for messages unacknowledged past the visibility timeout every ~30 s (kombu's
        # default is ~100 s); our own sweeper recovers dead workers' steps much sooner anyway.
        "unacked_restore_interval": settings.restore_interval,
        "unacked_restore_throttle": 3 if settings.restore_interval >= 5 else 1,
    }
    return {
        "broker_url": broker,
        "broker_transport_options": transport,
        "visibility_timeout": vt,
        "broker_connection_retry_on_startup": True,
        "broker_pool_acquire_timeout": 30,
        "result_backend": None,
        "task_ignore_result": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        # Steps on a Redis broker are consumed without acknowledgement (`steps_unacknowledged`):
        # their Request (`tasks/step.py`) then acknowledges and rejects nothing in the broker.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure": True,
        "task_acks_on_timeout": True,
        "worker_prefetch_multiplier": 1,
        # Take a message only when a process is free: a killed worker holds no waiting messages.
        "worker_disable_prefetch": True,
        # Recycling a pool process costs a fork and litellm's lazy imports again; the memory limit
        # below still replaces a process that grows.
        "worker_max_tasks_per_child": 100_000,
        "worker_max_memory_per_child": 1_000_000,
        "worker_soft_shutdown_timeout": 30.0,
        "worker_enable_soft_shutdown_on_idle": True,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "worker_hijack_root_logger": False,
        "task_default_queue": "steps",
        "task_queues": task_queues(broker),
        "task_routes": {
            STEP_TASK: {"queue": "steps"},
            CALL_TASK: {"queue": "tools"},
            ISOLATED_TASK: {"queue": "isolated"},
        },
        "task_create_missing_queues": True,
        # Time limits (prefork only; a threads pool cannot enforce them) stay below the visibility timeout.
        "task_annotations": {
            STEP_TASK: {"soft_time_limit": settings.step_time_limit * 0.9, "time_limit": settings.step_time_limit},
            CALL_TASK: _tool_limits(settings),
            ISOLATED_TASK: _tool_limits(settings),
        },
    }


def _tool_limits(settings: Settings) -> dict[str, float]:
    return {"soft_time_limit": settings.tool_time_limit * 0.95, "time_limit": settings.tool_time_limit}


def worker_argv(
    queues: list[str], concurrency: int, loglevel: str = "INFO", name: str | None = None, pool: str = "prefork"
) -> list[str]:
    """`celery worker` arguments the way celery-agents runs its workers (and the bench its yardstick)."""
    argv = [
        "worker",
        "-Q",
        ",".join(queues),
        "-c",
        str(concurrency),
        "-P",
        pool,
        "--without-gossip",
        "--without-mingle",
        "-l",
        loglevel,
    ]
    return argv + (["-n", name] if name else [])


def make_app(settings: Settings, main: str = "celery_agents") -> Celery:
    app = Celery(main, set_as_current=False)
    app.conf.update(celery_config(settings))
    return app


class Dispatcher:
    """Publishes steps and dispatched calls to the queues."""

    def __init__(self, app: Celery) -> None:
        self.app = app

    def step(self, session_id: str, version: int, request: str = "") -> None:
        self.app.send_task(
            STEP_TASK,
            args=(session_id, version, request),
            queue="steps",
            headers={PUBLISHED_MS: _now_ms()},
            argsrepr=step_argsrepr(session_id, version, request),
        )

    def call(self, session_id: str, call: TrackedCall) -> None:
        isolated = call.disposition == "runIsolated"
        self.app.send_task(
            ISOLATED_TASK if isolated else CALL_TASK,
            args=(session_id, call.field),
            queue="isolated" if isolated else "tools",
            headers={PUBLISHED_MS: _now_ms()},
            argsrepr=call_argsrepr(session_id, call),
        )


# What Flower, `celery events` and the workers' logs show as a task's arguments (Celery's
# `argsrepr`): named, with the call's tool, instead of a bare tuple. The message's own args stay
# the compact positional form the tasks take.
def step_argsrepr(session_id: str, version: int, request: str) -> str:
    return f"session={session_id} version={version}" + (f" request={request[:40]}" if request else "")


def call_argsrepr(session_id: str, call: TrackedCall) -> str:
    # The tool's name comes from the model by way of the agent file: quoted and cut, never trusted.
    return f"session={session_id} call={call.field} tool={call.tool[:64]!r} {call.disposition} id={call.call_id[:64]!r}"


def _now_ms() -> int:
    return int(time.time() * 1000)
