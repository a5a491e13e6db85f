"""The yardstick users would write instead of celery-agents: one plain Celery task per step that
makes the same model call (the bench agent's demo model through the same litellm adapter), with no
journal, no lease, no session state: it calls the model, then signals with one
`RPUSH <prefix>:bench:naive <tag>`.

Same configuration as celery-agents' workers (`celery_config`), its own queue `naive`, and the same
pool as `agents worker` runs steps with (threads), started the same number of times:

    celery -A bench.naive_celery worker -Q naive -P threads -c 200

`BENCH_NAIVE_MODEL` and `BENCH_NAIVE_API_BASE` point it at another model (`bench/latency_curve.py`:
a local server answering after a set delay).
"""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import Celery
from celery.signals import worker_init

from celery_agents.config import Settings
from celery_agents.tasks.config import celery_config

NAIVE_TASK = "bench.naive_step"
QUEUE = "naive"
MODEL = "demo/bench"


def done_key(prefix: str) -> str:
    return f"{prefix}:bench:naive"


def make_naive_app(settings: Settings) -> Celery:
    app = Celery("bench_naive", set_as_current=False)
    conf = celery_config(settings)
    conf.update(task_default_queue=QUEUE, task_routes={NAIVE_TASK: {"queue": QUEUE}})
    app.conf.update(conf)
    return app


settings = Settings.from_env()
app = make_naive_app(settings)
_state: dict[str, Any] = {}


@worker_init.connect  # type: ignore[untyped-decorator]
def _warm(**_: Any) -> None:
    # As `agents worker` does: litellm imported and one call made before the first task.
    from celery_agents.llm.adapter import warm_up

    warm_up()


def _clients() -> tuple[redis.Redis, Any, Any]:
    if _state.get("pid") != os.getpid():
        from celery_agents.llm import LitellmPort
        from celery_agents.scheduler.ports import LlmRequest
        from celery_agents.tools.resolve import parse_agent

        spec = {"slug": "bench", "model": os.environ.get("BENCH_NAIVE_MODEL", MODEL)}
        if os.environ.get("BENCH_NAIVE_API_BASE"):
            spec["apiBase"] = os.environ["BENCH_NAIVE_API_BASE"]
        agent = parse_agent(spec)
        _state.update(
            pid=os.getpid(),
            redis=redis.Redis.from_url(settings.redis_url or "", decode_responses=True),
            port=LitellmPort(),
            request=LlmRequest(agent=agent, messages=[{"role": "user", "content": "Hello"}], tools=[]),
        )
    return _state["redis"], _state["port"], _state["request"]


@app.task(name=NAIVE_TASK, ignore_result=True)  # type: ignore[untyped-decorator]
def naive_step(tag: str) -> None:
    client, port, request = _clients()
    port.complete(request)
    client.rpush(done_key(settings.prefix), tag)
