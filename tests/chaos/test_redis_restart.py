"""Redis killed (SIGKILL) and restarted from its append-only file (`appendfsync always`) between a
completion and the next step: nothing is lost, and a worker reconnects on its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from tests.chaos.conftest import Fleet
from tests.chaos.invariants import check_invariants
from tests.e2e.conftest import wait_for
from tests.support.llm_server import LlmServer, Reply, calls, text
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.slow


def approve_then_answer(body: dict[str, Any]) -> Reply:
    if body["messages"][-1]["role"] == "tool":
        return text(f"got {body['messages'][-1]['content']}")
    return calls(("approve", {"n": 1}))


def test_completion_survives_redis_crash(tmp_path: Path, prefix: str, llm_server: LlmServer, write_agent: Any) -> None:
    server = RedisServer(tmp_path / "redis", appendonly=True, appendfsync="always").start()
    try:
        settings = Settings(
            redis_url=server.url,
            prefix=prefix,
            home=tmp_path / "home",
            lease_seconds=2,
            owed_grace=1,
            sweep_interval=0.2,
        )
        scenario = llm_server.scenario([approve_then_answer])
        path = write_agent(
            {
                "slug": "restart",
                "model": f"openai/{scenario}",
                "apiBase": llm_server.url,
                "tools": [{"name": "approve", "external": True}],
            }
        )
        fleet = Fleet(server.url, prefix, tmp_path)
        try:
            worker = fleet.start()
            # 1. The completion and the step it owes are written, then Redis dies before any worker runs it.
            with Client(settings, inline=False) as client:
                view = client.start(path, "first", run=True, timeout=30)
                token = view.pending[0].token
                worker.stop()
                assert client.complete(token, {"approved": 1}).woken
            server.stop(kill=True)
            server.start()
            fleet.start()
            with Client(settings, inline=False) as client:
                store = client.store
                wait_for(
                    lambda: store.header(view.session_id).status.value == "completed",
                    timeout=60,
                    what="the session to finish after the restart",
                )
                assert store.header(view.session_id).response == 'got {"approved": 1}'
                check_invariants(store, view.session_id)

            # 2. A worker that is running while Redis dies reconnects and carries on.
            with Client(settings, inline=False) as client:
                view = client.start(path, "second", run=True, timeout=30)
                assert client.complete(view.pending[0].token, {"approved": 2}).woken
            server.stop(kill=True)
            server.start()
            with Client(settings, inline=False) as client:
                store = client.store
                wait_for(
                    lambda: store.header(view.session_id).status.value == "completed",
                    timeout=90,
                    what="the running worker to reconnect and finish",
                )
                assert store.header(view.session_id).response == 'got {"approved": 2}'
                check_invariants(store, view.session_id)
        finally:
            fleet.stop()
    finally:
        server.stop(kill=True)
