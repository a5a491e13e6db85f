"""The sweeper publishes again only what is truly lost: a step whose worker died is published once
more, not once per sweep while that copy waits in its queue; and a step owed while the sweeper
looks at the session is never dropped from the outbox."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.model import AgentSpec, UserQuery
from celery_agents.store import Store
from celery_agents.tasks.config import Dispatcher, make_app
from celery_agents.tasks.services import sweep_once
from tests.chaos.conftest import Fleet, report
from tests.chaos.invariants import check_invariants
from tests.e2e.conftest import record_tool, runs, wait_for
from tests.support.llm_server import LlmServer, Reply, calls, text
from tests.support.queues import depth

pytestmark = pytest.mark.slow


def one_slow_tool(body: dict[str, Any]) -> Reply:
    if body["messages"][-1]["role"] == "tool":
        return text("done")
    return calls(("sync_tool", {"x": 1, "sleep": 3}))


def test_a_dead_workers_step_is_published_again_once_while_no_worker_takes_steps(
    fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    log = tmp_path / "runs.jsonl"
    scenario = llm_server.scenario([one_slow_tool])
    tools = [record_tool("sync_tool", log)]
    path = write_agent({"slug": "sweep", "model": f"openai/{scenario}", "apiBase": llm_server.url, "tools": tools})
    doomed = fleet.start()
    fleet.start(queues="tools")  # sweeps, takes no step
    broker = f"{fleet.prefix}:celery:"
    raw = redis.Redis.from_url(fleet.redis_url)
    with Client(chaos_settings, inline=False) as client:
        sid = client.start(path, "go", run=True, wait=False).session_id
        wait_for(lambda: runs(log, "sync_tool", phase="start"), what="the tool to start")
        doomed.kill()
        # Lease 2 s, grace 1 s, a sweep every 0.2 s: the dead step is owed again within ~3 s.
        wait_for(lambda: depth(raw, broker) >= 1, timeout=15, what="the dead worker's step to be published again")
        time.sleep(6)  # six more grace periods with nobody taking steps: nothing is lost meanwhile
        copies = depth(raw, broker)
        assert copies == 1, f"{copies} copies of one step wait in the queue"
        fleet.start()
        wait_for(lambda: client.store.header(sid).status.value != "active", timeout=60, what="the session to finish")
        check_invariants(client.store, sid)
    report("sweeper copies while no step consumer", copies_after_6s=copies)


class _ActAfterRead:
    """A client whose first pipeline that reads sessions (HMGET, or a script) runs `action` right
    after it executes: a commit landing between the sweeper's read and what it does next."""

    def __init__(self, client: redis.Redis, action: Any) -> None:
        self.client, self.action, self.done = client, action, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        pipe = self.client.pipeline(*args, **kwargs)
        execute = pipe.execute

        def execute_then_act(*a: Any, **kw: Any) -> Any:
            reads = any(str(args[0]).upper() in ("HMGET", "EVALSHA") for args, _ in pipe.command_stack)
            out = execute(*a, **kw)
            if reads and not self.done:
                self.done = True
                self.action()
            return out

        pipe.execute = execute_then_act
        return pipe


class _Recorder(Dispatcher):
    def __init__(self, settings: Settings) -> None:
        super().__init__(make_app(settings))
        self.steps: list[tuple[str, int]] = []

    def step(self, session_id: str, version: int, request: str = "") -> None:
        self.steps.append((session_id, version))


def test_a_step_owed_while_the_sweeper_reads_is_not_dropped(store: Store) -> None:
    agent = AgentSpec.model_validate({"slug": "owed", "model": "demo/echo"})
    sid = store.create_session(agent, UserQuery(text="hi"), drive="auto").session_id
    k = store.keys
    # A leftover outbox entry: nothing is owed (no owed_version), the sweeper should tidy it...
    store.client.zadd(k.owed, {sid: int((time.time() - 60) * 1000)})

    def wake() -> None:  # ... but a completion wakes the session right after the sweeper read it
        store.client.zadd(k.owed, {sid: int(time.time() * 1000)})
        store.client.hset(k.meta(sid), "owed_version", store.header(sid).version)

    racing = Store(_ActAfterRead(store.client, wake), store.settings)  # type: ignore[arg-type]
    sweep_once(racing, _Recorder(store.settings), store.settings, time.time())
    assert store.client.zscore(k.owed, sid) is not None, "the step owed meanwhile is still in the outbox"
