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
from celery_agents.model.admission import DEFAULT_PRIORITY, PRIORITY_MAX, PRIORITY_MIN
from celery_agents.redis_urls import is_sentinel_url
from celery_agents.store import Keys, broker_url
from celery_agents.store.connection import broker_options, broker_ssl

#: a message header: when it was published (ms since the epoch, the publisher's clock)
PUBLISHED_MS = "agents_published_ms"
#: broker URL schemes of kombu's Redis transport (its Sentinel one included, as kombu and as
#: `AGENTS_BROKER_URL` name it): its queues are lists, read directly
REDIS_SCHEMES = {"redis", "rediss", "redis+socket", "sentinel", "redis+sentinel", "rediss+sentinel"}

STEP_TASK = "celery_agents.step"
CALL_TASK = "celery_agents.run_call"
ISOLATED_TASK = "celery_agents.run_isolated_call"
QUEUES = ("steps", "tools", "isolated")
#: how late Celery's timer may run a countdown (s), a step a fleet limit put back (`celery_config`)
TIMER_PRECISION_S = 0.02
#: the lists of a queue on kombu's Redis transport, one per message priority (tasks/queues.py)
PRIORITY_STEPS = tuple(range(PRIORITY_MAX + 1))


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
    Celery would make them), `steps` consumed without acknowledgement on a Redis broker and, on
    any other (AMQP), declared a priority queue (`x-max-priority`)."""
    no_ack, amqp = steps_unacknowledged(broker), not _redis_transport(broker)
    return tuple(
        _queue(name, no_ack=no_ack and name == "steps", prioritised=amqp and name == "steps") for name in QUEUES
    )


def _queue(name: str, no_ack: bool, prioritised: bool = False) -> Queue:
    exchange = Exchange(name, type="direct")  # type: ignore[no-untyped-call]  # kombu is untyped
    arguments = {"x-max-priority": PRIORITY_MAX} if prioritised else None
    return Queue(name, exchange, routing_key=name, no_ack=no_ack, queue_arguments=arguments)  # type: ignore[no-untyped-call]


def message_priority(broker: str, priority: int) -> int:
    """The message priority that puts a session of `priority` (0 lowest, 9 highest) before the
    ones below it. kombu's Redis transport keeps a list per priority (`PRIORITY_STEPS`) and takes
    from the list of the lowest number first; AMQP (RabbitMQ, `x-max-priority`) delivers the
    highest number first."""
    p = min(max(priority, PRIORITY_MIN), PRIORITY_MAX)
    return PRIORITY_MAX - p if _redis_transport(broker) else p


def _redis_transport(broker: str) -> bool:
    """kombu's Redis transport (and its Sentinel one) serves broker URL `broker`."""
    scheme = broker.split("://", 1)[0]
    return scheme in REDIS_SCHEMES or "redis" in scheme or "sentinel" in scheme


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
        # A list per session priority (kombu's default steps, 0 3 6 9, would fold ten into four).
        "priority_steps": list(PRIORITY_STEPS),
        **broker_options(settings),
    }
    tls = broker_ssl(settings)
    return {
        "broker_url": broker,
        "broker_transport_options": transport,
        # A rediss:// URL carries its own TLS options; a rediss+sentinel:// one gives them here.
        **({"broker_use_ssl": tls} if tls is not None else {}),
        "task_publish_retry_policy": _publish_retry(settings),
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
        # A running task goes on when the broker connection drops (a Redis restart): a tool call in
        # flight finishes and records its outcome once Redis is back (the store waits for it), instead
        # of being killed and run again. A copy the broker hands out meanwhile is refused by the
        # call's lease or the step's.
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "worker_hijack_root_logger": False,
        # A step a fleet limit put back runs at its countdown (tasks/step.py). A threads pool keeps
        # countdowns in Celery's timer thread, which sleeps up to this long before it sees an entry
        # due sooner than the one it sleeps for (default 1 s: steps due within a second would all
        # start together at its end, in a burst a provider's limit refuses).
        "worker_timer_precision": TIMER_PRECISION_S,
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


def _publish_retry(settings: Settings) -> dict[str, float]:
    """How long publishing a message retries a broker it cannot reach: Celery's default (~0.6 s)
    on one server; on Sentinel long enough for the sentinels to promote a replica (a few seconds)
    rather than leave the message to the sweeper (`AGENTS_OWED_GRACE` later)."""
    if not is_sentinel_url(settings.broker_url or settings.redis_url):
        return {"max_retries": 3, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.2}
    return {"max_retries": 40, "interval_start": 0, "interval_step": 0.25, "interval_max": 1.0}


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
        self._broker = str(app.conf.broker_url or "")

    def step(
        self,
        session_id: str,
        version: int,
        request: str = "",
        priority: int = DEFAULT_PRIORITY,
        countdown: float | None = None,
    ) -> None:
        """Publish a step of `session_id` at `version`, taken before the steps of sessions of a
        lower `priority`; `countdown` (s): not run before then (a step a fleet limit put back)."""
        self.app.send_task(
            STEP_TASK,
            args=(session_id, version, request),
            queue="steps",
            headers={PUBLISHED_MS: _now_ms()},
            argsrepr=step_argsrepr(session_id, version, request),
            priority=message_priority(self._broker, priority),
            countdown=countdown if countdown else None,
        )

    def call(self, session_id: str, call: TrackedCall) -> None:
        isolated = call.runs_as == "runIsolated"
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
