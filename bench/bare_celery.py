"""The yardstick: a bare Celery app with one no-op task, on the same broker settings as
celery-agents' workers (`celery_agents.tasks.config.celery_config`: JSON only, late acks, requeue
on a lost worker, prefetch 1, the same transport options), its own queue `bare`.

The task signals that it ran with one `RPUSH <prefix>:bench:done <tag>` (no result backend); the
benchmark waits on that list with BLPOP, as it waits on a session's event stream for a step.

    celery -A bench.bare_celery worker -Q bare -c 2 -P prefork
"""

from __future__ import annotations

import os

import redis
from celery import Celery

from celery_agents.config import Settings
from celery_agents.tasks.config import celery_config

NOOP_TASK = "bench.noop"
QUEUE = "bare"


def done_key(prefix: str) -> str:
    return f"{prefix}:bench:done"


def make_bare_app(settings: Settings) -> Celery:
    app = Celery("bench_bare", set_as_current=False)
    conf = celery_config(settings)
    conf.update(task_default_queue=QUEUE, task_routes={NOOP_TASK: {"queue": QUEUE}})
    app.conf.update(conf)
    return app


settings = Settings.from_env()
app = make_bare_app(settings)
_client: tuple[int, redis.Redis] | None = None


def _redis() -> redis.Redis:
    global _client
    if _client is None or _client[0] != os.getpid():
        _client = (os.getpid(), redis.Redis.from_url(settings.redis_url or "", decode_responses=True))
    return _client[1]


@app.task(name=NOOP_TASK, ignore_result=True)  # type: ignore[untyped-decorator]
def noop(tag: str) -> None:
    _redis().rpush(done_key(settings.prefix), tag)
