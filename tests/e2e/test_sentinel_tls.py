"""`rediss+sentinel://`: Redis servers and sentinels that speak TLS (certificates checked against
a CA), replication over TLS. A real worker reaches state and queues through the sentinels with
TLS, a session waits on a deferred call, the primary is killed, and the completion given after
the failover finishes the session on the promoted replica."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.sentinel import SentinelManagedSSLConnection

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.store import client_for_url
from tests.cli.process import DEMO_AGENT
from tests.e2e.conftest import wait_for
from tests.e2e.test_secured_redis import _certificates
from tests.support.sentinel import SentinelSet
from tests.support.workers import Worker, worker_env

pytestmark = pytest.mark.slow


@pytest.fixture
def tls_sentinels(tmp_path: Path) -> Iterator[SentinelSet]:
    if shutil.which("openssl") is None or not Path("/usr/bin/redis-server").exists():
        pytest.skip("needs openssl and a redis-server built with TLS")
    certs = _certificates(tmp_path)
    s = SentinelSet(tmp_path / "sentinel", tls=certs)
    try:
        s.start()
    except (RuntimeError, AssertionError) as exc:
        s.stop()
        pytest.skip(f"this redis-server does not run TLS: {exc}")
    yield s
    s.stop()


def test_state_and_queues_over_tls_sentinels_follow_a_failover(tls_sentinels: SentinelSet, tmp_path: Path) -> None:
    url = tls_sentinels.url()
    assert url.startswith("rediss+sentinel://")
    prefix = f"tls{uuid.uuid4().hex[:6]}"
    worker = Worker(
        worker_env(url, prefix, tmp_path / "home", AGENTS_LEASE_SECONDS="10"),
        log=tmp_path / "worker.log",
        name=f"tls-{uuid.uuid4().hex[:6]}@test",
    ).start()
    state = client_for_url(url)
    try:
        # Only TLS ports are named (the sentinels'), and the sentinels name the servers' TLS ports:
        # neither the state client nor kombu reaches anything without TLS.
        assert state.connection_pool.connection_class is SentinelManagedSSLConnection
        worker.wait_ready(state, prefix)
        with Client(Settings(redis_url=url, prefix=prefix, home=tmp_path / "home")) as client:
            view = client.start(DEMO_AGENT, "Please book a table in Paris.", run=True, timeout=60)
            [pending] = view.pending
            old = tls_sentinels.kill_master()
            tls_sentinels.wait_failover(old.port)
            assert pending.token is not None
            client.complete(pending.token, {"booked": True})
            done = wait_for(
                lambda: (v := client.view(view.session_id)).state.value == "completed" and v,
                timeout=90,
                what="the session to complete on the promoted replica",
            )
        assert done.response
    finally:
        worker.stop()
        state.close()
