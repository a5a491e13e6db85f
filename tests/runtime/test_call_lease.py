"""A dispatched call's lease is released atomically: a worker whose lease lapsed and was taken
over (between its last look and its release) never deletes the new holder's lease."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis

from celery_agents.config import Settings
from celery_agents.llm import LitellmPort
from celery_agents.model import AgentSpec, CallOutcome, TrackedCall
from celery_agents.runtime import run_call, run_step
from celery_agents.store import Store
from celery_agents.tools import ToolRunner
from celery_agents.tools.resolve import load_agent_file

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo-agent.json"


class TakenOverOnRelease(redis.Redis):
    """Once armed, the next command that touches `key` is followed at once by another worker
    taking that key (the lease lapsed there and then)."""

    key = ""
    armed = False

    def execute_command(self, *args: Any, **options: Any) -> Any:
        out = super().execute_command(*args, **options)
        if self.armed and self.key in args:
            self.armed = False
            super().execute_command("SET", self.key, "worker-b")
        return out


def test_a_lapsed_call_lease_taken_over_is_not_released_by_the_first_worker(settings: Settings) -> None:
    client = TakenOverOnRelease.from_url(settings.redis_url or "", decode_responses=True)
    store = Store(client, settings)
    sid = store.create_session(load_agent_file(DEMO), _query(), drive="manual").session_id
    llm, tools = LitellmPort(), ToolRunner()
    run_step(store, sid, 1, llm=llm, tools=tools, owner="w")
    field = run_step(store, sid, 2, llm=llm, tools=tools, owner="w").dispatch[0].field
    lease_key = store.keys.call_lease(sid, field)

    class ArmWhenDone:
        def run(self, agent: AgentSpec, session_id: str, call: TrackedCall) -> CallOutcome:
            outcome = tools.run(agent, session_id, call)
            client.key, client.armed = lease_key, True  # what comes next is the release
            return outcome

    done = run_call(store, sid, field, ArmWhenDone(), "worker-a", "runAsync")  # type: ignore[arg-type]
    assert done.status == "ok"
    assert client.get(lease_key) == "worker-b", "worker-b's lease survives worker-a's release"
    client.close()


def _query() -> Any:
    from celery_agents.model import UserQuery

    return UserQuery(text="What is the weather in Paris?")
