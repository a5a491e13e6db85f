"""Redis loses its last writes (a replica promoted before it had them; a power cut with
`appendfsync everysec`), and the session moves on from the older state. A worker that cached the
lost turns must notice that the stored transcript is not the one it read, never mix the two, and
`agents doctor` must show the session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_agents import Client
from celery_agents.config import Settings
from tests.chaos.conftest import report
from tests.chaos.invariants import check_invariants
from tests.e2e.conftest import record_tool, runs, wait_for
from tests.scheduler.fakes import ScriptedLlm, llm_turn
from tests.support.llm_server import LlmServer, Reply, calls, text
from tests.support.proxy import TcpProxy
from tests.support.redis_server import RedisServer
from tests.support.workers import Worker, worker_env

pytestmark = pytest.mark.slow


class Pair:
    """A primary, its replica, and the proxy clients reach Redis through (pointing at the primary)."""

    def __init__(self, tmp: Path) -> None:
        self.primary = RedisServer(tmp / "primary").start()
        self.replica = RedisServer(tmp / "replica").start()
        self.proxy = TcpProxy(self.primary.port).start()
        self.p = redis.Redis(port=self.primary.port, decode_responses=True)
        self.r = redis.Redis(port=self.replica.port, decode_responses=True)
        self.r.replicaof("127.0.0.1", self.primary.port)
        wait_for(lambda: self.r.info("replication")["master_link_status"] == "up", what="the replica to sync")

    def promote_replica(self) -> None:
        """The replica stops following, with what it has now: later writes to the primary are lost."""
        assert self.p.wait(1, 5000) == 1, "the replica has every write so far"
        self.r.replicaof("no", "one")

    def fail_over(self) -> None:
        """Clients now reach the promoted replica (the primary's last writes are gone for them)."""
        self.proxy.switch(self.replica.port)

    def close(self) -> None:
        self.proxy.stop()
        for c in (self.p, self.r):
            c.close()
        self.primary.stop(kill=True)
        self.replica.stop(kill=True)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    p = Pair(tmp_path)
    yield p
    p.close()


def test_a_worker_never_mixes_cached_turns_with_a_transcript_that_went_back(
    pair: Pair, prefix: str, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    log = tmp_path / "runs.jsonl"

    def model(body: dict[str, Any]) -> Reply:
        return text("done") if body["messages"][-1]["role"] == "tool" else calls(("tool_lost", {"x": 1}))

    scenario = llm_server.scenario([model])
    path = write_agent(
        {
            "slug": "failover",
            "model": f"openai/{scenario}",
            "apiBase": llm_server.url,
            "tools": [record_tool("tool_lost", log), record_tool("tool_kept", log)],
        }
    )
    # Session state goes through the proxy; the broker stays on the primary's own port.
    settings = Settings(
        redis_url=pair.proxy.url, broker_url=pair.primary.url, prefix=prefix, home=tmp_path / "home", owed_grace=1
    )
    worker = Worker(
        worker_env(pair.proxy.url, prefix, AGENTS_BROKER_URL=pair.primary.url, AGENTS_LEASE_SECONDS="2"),
        concurrency=1,
        log=tmp_path / "worker.log",
    ).start()
    try:
        worker.wait_ready(pair.p, prefix)
        with Client(settings, inline=False) as client:
            sid = client.start(path, "go").session_id
            pair.promote_replica()
            # The worker asks the model and caches the turn [query, call tool_lost]: on the primary only.
            assert client.step(sid, timeout=60).state.value == "tools"
            pair.fail_over()
            # On the promoted replica the session is back at its query; another process moves it on.
            other = ScriptedLlm(llm_turn(("call_kept", "tool_kept", '{"x": 2}')))
            with Client(settings, inline=True, llm=other) as elsewhere:
                assert elsewhere.step(sid).state.value == "tools"
            # The worker runs the next step: the call in the stored transcript, not the lost one.
            client.step(sid, timeout=60)
            client.step(sid, timeout=60)
            h = client.store.header(sid)
            ran = [r["tool"] for r in runs(log, phase="start")]
            report("failover", status=h.status.value, tools_run=ran)
            assert ran == ["tool_kept"], "the lost turn's call never runs"
            check_invariants(client.store, sid)
            doctor = client.doctor()
            (check,) = [c for c in doctor["checks"] if c["name"] == "rewound sessions"]
            assert not check["ok"] and sid in check["detail"]
    finally:
        worker.kill()
