"""What a step costs the broker, counted with INFO commandstats on a private redis-server around a
real `agents worker`: the publish (`LPUSH`) and the take (`BRPOP`), nothing more. Step messages
are taken without acknowledgement, so kombu's bookkeeping of unacknowledged messages (`MULTI ZADD
HSET EXEC` when a message is taken, `MULTI ZREM HDEL EXEC` when it is acknowledged: 8 commands
and two round trips) is gone; a regression would show here as 4 transactions' commands per step."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from celery_agents.config import Settings
from celery_agents.model import UserQuery
from celery_agents.store import Store
from celery_agents.tasks.config import Dispatcher, make_app
from celery_agents.tools.resolve import parse_agent
from tests.e2e.conftest import wait_for
from tests.support.redis_server import RedisServer
from tests.support.workers import Worker, worker_env

pytestmark = pytest.mark.slow

STEPS = 40
#: the commands of Celery's broker traffic that no script of ours issues
CELERY_COMMANDS = ("lpush", "brpop", "multi", "exec")


def _counts(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name: int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in CELERY_COMMANDS}


def test_a_step_costs_the_broker_its_publish_and_its_take(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    prefix = "cmds"
    settings = Settings(redis_url=server.url, prefix=prefix, home=tmp_path / "home")
    client = redis.Redis.from_url(server.url, decode_responses=True)
    store = Store(client, settings)
    app = make_app(settings, main="broker_commands")
    dispatcher = Dispatcher(app)
    agent = parse_agent({"slug": "cmds", "model": "demo/bench"})
    worker = Worker(worker_env(server.url, prefix), log=tmp_path / "worker.log", step_threads=8).start()
    done = store.keys.state_index("completed")

    def run(n: int) -> None:
        target = client.zcard(done) + n
        sids = [store.create_session(agent, UserQuery(text="hi")).session_id for _ in range(n)]
        for sid in sids:
            dispatcher.step(sid, 1)
        wait_for(lambda: client.zcard(done) >= target, timeout=120, what=f"{n} steps")

    try:
        worker.wait_ready(client, prefix)
        run(3)  # scripts loaded, pools grown
        before = _counts(client)
        run(STEPS)
        after = _counts(client)
    finally:
        worker.stop()
        app.close()
        server.stop(kill=True)
    per_step = {name: (after[name] - before[name]) / STEPS for name in CELERY_COMMANDS}
    print(f"\n[broker] per step: {per_step}")
    assert per_step["lpush"] == 1, "one publish per step"
    # A worker waiting for messages issues one BRPOP a second (kombu's timeout) besides the step's.
    assert per_step["brpop"] <= 1.5
    # kombu's restore of unacknowledged tool calls may take its mutex once (one MULTI/EXEC) meanwhile.
    assert per_step["multi"] + per_step["exec"] <= 0.1, "no unacknowledged-message bookkeeping per step"
    assert sum(per_step.values()) <= 2.6
