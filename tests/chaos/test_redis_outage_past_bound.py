"""Redis away for longer than a worker waits for it (`AGENTS_REDIS_OUTAGE_SECONDS`, 1 s here;
Redis killed and restarted from its append-only file after 5 s), with work in flight on one real
worker: steps waiting on the model, runSync tools running in steps, runAsync calls running in the
tools pool, and completions the consumer has read and not yet applied.

- A step whose model answered while Redis was away gives up once the bound has passed, says so
  in the log and writes nothing: it is taken up again once Redis is back, and asks the model
  again (the one thing giving up costs).
- A tool that ran is never given up on: its outcome (a runSync tool's journal entry, a runAsync
  call's result) is written as soon as Redis answers, however long that takes, so no tool runs
  twice.
- The consumer's entries stay pending in the group and are applied once, after the outage.

Every session completes; model calls, tool runs and applied completions are counted exactly."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import Counter
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

AT_MODEL, IN_TOOL, IN_CALL, TO_COMPLETE = 4, 4, 2, 3
BOUND_S = 1.0
#: how long Redis stays away: well past the bound and the 2 s lease
OUTAGE_S = 5.0
#: the consumer stops this long after reading entries (AGENTS_FAULT_PAUSE): Redis goes meanwhile
PAUSE_S = 2.0


class Conversation:
    """By the prompt: "at the model" answers are held until `released`, then ask for `effect`;
    "in a tool" asks for `effect` (runSync) and "in a call" for `async_effect` (runAsync), both
    waiting on the gate; "to complete" asks for `ask` (deferred). After a tool's answer: "done".
    Counts the requests of each prompt."""

    def __init__(self, gate: Path) -> None:
        self.gate = str(gate)
        self.released = threading.Event()
        self.lock = threading.Lock()
        self.held = 0
        self.asked: Counter[str] = Counter()

    def __call__(self, body: dict[str, Any]) -> Reply:
        prompt = next(m["content"] for m in body["messages"] if m["role"] == "user")
        prompt = prompt if isinstance(prompt, str) else json.dumps(prompt)
        with self.lock:
            self.asked[prompt] += 1
        if body["messages"][-1]["role"] == "tool":
            return text("done")
        if "at the model" in prompt:
            with self.lock:
                self.held += 1
            self.released.wait(120)
            return calls(("effect", {"x": 1}))
        if "to complete" in prompt:
            return calls(("ask", {"x": 1}))
        tool = "async_effect" if "in a call" in prompt else "effect"
        return calls((tool, {"x": 1, "gate": self.gate}))


def test_past_the_outage_bound_steps_give_up_cleanly_and_no_tool_runs_twice(
    tmp_path: Path, prefix: str, llm_server: LlmServer, chaos_settings: Settings
) -> None:
    server = RedisServer(tmp_path / "redis", appendonly=True, appendfsync="always").start()
    gate, log = tmp_path / "gate", tmp_path / "runs.jsonl"
    model = Conversation(gate)
    scenario = llm_server.scenario([model])
    agent = parse_agent(
        {
            "slug": "outage-past",
            "model": f"openai/{scenario}",
            "apiBase": llm_server.url,
            "tools": [record_tool("effect", log), record_tool("async_effect", log), record_tool("ask", log)],
            "toolCallPolicy": {
                "default": "runSync",
                "rules": [
                    {"tool": "async_effect", "disposition": "runAsync"},
                    {"tool": "ask", "disposition": "defer"},
                ],
            },
        }
    )
    settings = dataclasses.replace(chaos_settings, redis_url=server.url)
    fleet = Fleet(server.url, prefix, tmp_path)
    app = make_app(settings, main="chaos_outage_past")
    try:
        worker = fleet.start(
            concurrency=IN_CALL,
            AGENTS_REDIS_OUTAGE_SECONDS=str(BOUND_S),
            AGENTS_FAULT_PAUSE="completion_read",
            AGENTS_FAULT_PAUSE_SECONDS=str(PAUSE_S),
        )
        store = Store(fleet.client, settings)
        kinds = {"at the model": AT_MODEL, "in a tool": IN_TOOL, "in a call": IN_CALL, "to complete": TO_COMPLETE}
        prompts = [f"{kind} {n}" for kind, count in kinds.items() for n in range(count)]
        sids = {p: store.create_session(agent, UserQuery(text=p), drive="auto", owe=True).session_id for p in prompts}
        for sid in sids.values():
            Dispatcher(app).step(sid, 1)
        waiting = [sids[p] for p in prompts if p.startswith("to complete")]
        wait_for(
            lambda: (
                model.held == AT_MODEL
                and len(runs(log, phase="start")) == IN_TOOL + IN_CALL
                and all(store.pending_calls(s) and store.pending_calls(s)[0].token for s in waiting)
            ),
            timeout=120,
            what="model calls held, tools running and deferred calls waiting",
        )
        for sid in waiting:
            token = store.pending_calls(sid)[0].token
            fleet.client.xadd(store.keys.completions, {"token": token or "", "result": '"approved"'})
        wait_for(lambda: fleet.client.get(store.keys.fault("completion_read")), what="the consumer to read them")
        server.stop(kill=True)
        down_at = time.monotonic()
        model.released.set()  # while Redis is away: the held model calls answer, the tools finish
        gate.touch()
        wait_for(lambda: len(runs(log)) == IN_TOOL + IN_CALL, timeout=30, what="the tools to finish")
        wait_for(
            lambda: "gave up, nothing of it written" in worker.log.read_text(), timeout=30, what="a step to give up"
        )
        time.sleep(max(0.0, down_at + OUTAGE_S - time.monotonic()))  # the outage's length is the scenario
        server.start()
        outage = time.monotonic() - down_at
        wait_for(
            lambda: all(store.header(s).status.value != "active" for s in sids.values()),
            timeout=120,
            what="every session to finish after the restart",
        )
        said = worker.log.read_text()
        gave_up = said.count("gave up, nothing of it written")
        for sid in sids.values():
            check_invariants(store, sid)
            assert store.header(sid).response == "done", (sid, store.header(sid))
        starts = runs(log, phase="start")
        applied = store.counters().get(("completions", "applied"), 0)
        rejected = fleet.client.xlen(store.keys.rejected)
        report(
            "redis away past the bound",
            outage_s=round(outage, 1),
            steps_gave_up=gave_up,
            model_requests=sum(model.asked.values()),
            tool_runs=len(starts),
            applied=applied,
        )
        assert gave_up >= AT_MODEL, said[-3000:]
        assert "completions: cannot reach Redis" in said, "the consumer met the outage"
        assert "a tool's outcome waits for Redis past AGENTS_REDIS_OUTAGE_SECONDS" in said
        for prompt in prompts:
            # A step that gave up its model answer asks again; every other step asked once.
            expected = 3 if prompt.startswith("at the model") else 2
            assert model.asked[prompt] == expected, (prompt, model.asked[prompt])
        assert len(starts) == AT_MODEL + IN_TOOL + IN_CALL, f"{len(starts)} tool runs: some ran twice"
        assert len({r["key"] for r in starts}) == len(starts)
        assert (applied, rejected) == (TO_COMPLETE, 0), "each completion applied once, none refused"
    finally:
        model.released.set()
        fleet.stop()
        app.close()
        server.stop(kill=True)
