"""One real worker for every CLI test, on the private Redis under its own prefix (a worker takes
seconds to start); each test makes its own sessions and agent files."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from celery_agents.store import client_for_url
from tests.cli.process import cli_env
from tests.support.workers import Worker, worker_env


@pytest.fixture(scope="package")
def cli_prefix() -> str:
    return f"cli{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="package")
def cli_redis(redis_url: str) -> Iterator[redis.Redis]:
    client = client_for_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="package")
def cli_worker(
    redis_url: str, cli_prefix: str, cli_redis: redis.Redis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    log = tmp_path_factory.mktemp("cli-worker") / "worker.log"
    # No isolated queue: `session run-isolated` is how those calls run here (test_run_isolated).
    worker = Worker(worker_env(redis_url, cli_prefix), queues="steps,tools", log=log).start()
    try:
        worker.wait_ready(cli_redis, cli_prefix)
        yield worker
    finally:
        worker.kill()  # nothing is in flight by then; a soft shutdown would only cost seconds


@pytest.fixture(scope="package")
def qenv(redis_url: str, cli_prefix: str) -> dict[str, str]:
    """The environment of a CLI process in queue mode, next to the package's worker."""
    return cli_env(redis_url, cli_prefix)
