"""Redis killed (SIGKILL) and restarted from its append-only file while 158 sessions have work in
flight on one worker: 75 steps waiting on the model, 75 steps in a runSync tool, 8 runAsync calls
in the tools worker. The model answers and the tools finish while Redis is away; what they did is
kept in the worker and committed once Redis is back: every session asks the model exactly twice,
every tool runs exactly once, every session completes."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from celery_agents.config import Settings
from celery_agents.model import UserQuery
from celery_agents.store import Store
from celery_agents.tasks.config import Dispatcher, make_app
from celery_agents.tools.resolve import parse_agent
from tests.chaos.conftest import Fleet, report
from tests.chaos.invariants import check_invariants
from tests.e2e.conftest import record_tool, runs, wait_for
from tests.support.llm_server import LlmServer, Reply, calls, text
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.slow

AT_MODEL = 75
IN_TOOL = 75
#: one tools pool process each
IN_CALL = 8
#: how long Redis stays away (a restart of a loaded server takes seconds); the chaos lease is 2 s
OUTAGE_S = 4.0


class Conversation:
    """First answer: a call of `effect` (runSync) or `async_effect` (runAsync), by the prompt; the
    answers of the sessions "at the model" are held until `released`; after the tool: "done"."""

    def __init__(self, gate: Path) -> None:
        self.gate = str(gate)
        self.released = threading.Event()
        self.lock = threading.Lock()
        self.held = 0
        self.answered = 0

    def __call__(self, body: dict[str, Any]) -> Reply:
        last = body["messages"][-1]
        if last["role"] == "tool":
            return text("done")
        prompt = json.dumps(last.get("content"))
        if "at the model" in prompt:
            with self.lock:
                self.held += 1
            self.released.wait(120)
            with self.lock:
                self.answered += 1
            return calls(("effect", {"x": 1}))
        tool = "async_effect" if "in a call" in prompt else "effect"
        return calls((tool, {"x": 1, "gate": self.gate}))


def test_a_redis_restart_under_load_redoes_nothing(
    tmp_path: Path, prefix: str, llm_server: LlmServer, chaos_settings: Settings
) -> None:
    server = RedisServer(tmp_path / "redis", appendonly=True, appendfsync="always").start()
    gate, log = tmp_path / "gate", tmp_path / "runs.jsonl"
    model = Conversation(gate)
    scenario = llm_server.scenario([model])
    agent = parse_agent(
        {
            "slug": "outage",
            "model": f"openai/{scenario}",
            "apiBase": llm_server.url,
            "tools": [record_tool("effect", log), record_tool("async_effect", log)],
            "toolCallPolicy": {"default": "runSync", "rules": [{"tool": "async_effect", "disposition": "runAsync"}]},
        }
    )
    settings = dataclasses.replace(chaos_settings, redis_url=server.url)
    fleet = Fleet(server.url, prefix, tmp_path)
    app = make_app(settings, main="chaos_outage")
    try:
        fleet.start(concurrency=IN_CALL)
        store = Store(fleet.client, settings)
        prompts = ["at the model"] * AT_MODEL + ["in a tool"] * IN_TOOL + ["in a call"] * IN_CALL
        sids = [store.create_session(agent, UserQuery(text=p), drive="auto", owe=True).session_id for p in prompts]
        for sid in sids:
            Dispatcher(app).step(sid, 1)
        wait_for(
            lambda: model.held == AT_MODEL and len(runs(log, phase="start")) == IN_TOOL + IN_CALL,
            timeout=120,
            what=f"{AT_MODEL} model calls held and {IN_TOOL + IN_CALL} tools running",
        )
        server.stop(kill=True)
        down_at = time.monotonic()
        # While Redis is away: the model answers, the tools finish.
        model.released.set()
        gate.touch()
        wait_for(lambda: len(runs(log)) == IN_TOOL + IN_CALL, timeout=30, what="the tools to finish")
        wait_for(lambda: model.answered == AT_MODEL, what="the held model answers to go out")
        time.sleep(max(0.0, down_at + OUTAGE_S - time.monotonic()))  # the outage itself: its length is the scenario
        server.start()
        outage = time.monotonic() - down_at
        wait_for(
            lambda: all(store.header(s).status.value != "active" for s in sids),
            timeout=120,
            what="every session to finish after the restart",
        )
        for sid in sids:
            check_invariants(store, sid)
            assert store.header(sid).response == "done"
        requests = llm_server.count(scenario)
        starts = runs(log, phase="start")
        report("redis_restart_under_load", outage_s=round(outage, 1), model_requests=requests, tool_runs=len(starts))
        assert requests == 2 * len(sids), f"{requests - 2 * len(sids)} model calls made again"
        assert len(starts) == len(sids), f"{len(starts) - len(sids)} tool runs repeated"
        assert len({r["key"] for r in starts}) == len(sids)
    finally:
        model.released.set()
        fleet.stop()
        app.close()
        server.stop(kill=True)
