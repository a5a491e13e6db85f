"""What a worker process builds once (its Store, with the transcript cache and one Redis connection
pool; its model and tool runners) is built once also when the first steps of a threads-pool
steps worker start in many threads at the same moment."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from celery_agents.config import Settings
from celery_agents.tasks import context
from celery_agents.tasks.context import WorkerContext, worker_context

THREADS = 16


@pytest.fixture
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(context, "_ctx", None)
    yield
    if context._ctx is not None:
        context._ctx.store.client.close()


def test_threads_that_start_together_share_one_worker_context(settings: Settings, fresh_process: None) -> None:
    barrier = threading.Barrier(THREADS)
    got: list[WorkerContext] = []

    def first_step() -> None:
        barrier.wait()
        got.append(worker_context(settings))

    threads = [threading.Thread(target=first_step) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(got) == THREADS
    assert len({id(c) for c in got}) == 1, "one Store (one turn cache, one connection pool) per process"
