"""Chaos fixtures: short leases and grace periods so recovery is fast, workers started per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_agents.config import Settings
from tests.support.workers import Worker, worker_env

CHAOS_ENV = {
    "AGENTS_LEASE_SECONDS": "2",
    "AGENTS_OWED_GRACE": "1",
    "AGENTS_SWEEP_INTERVAL": "0.2",
}


class Fleet:
    """Workers of one test, all on one prefix; stopped at the end."""

    def __init__(self, redis_url: str, prefix: str, logdir: Path) -> None:
        self.redis_url, self.prefix, self.logdir = redis_url, prefix, logdir
        self.workers: list[Worker] = []
        self.client = redis.Redis.from_url(redis_url, decode_responses=True)

    def start(
        self,
        concurrency: int = 1,
        wait: bool = True,
        queues: str = "steps,tools,isolated",
        step_threads: int | None = None,
        fork: bool = True,
        **env: str,
    ) -> Worker:
        merged = {**CHAOS_ENV, **env}
        w = Worker(
            worker_env(self.redis_url, self.prefix, **merged),
            queues=queues,
            concurrency=concurrency,
            step_threads=step_threads,
            fork=fork,
            log=self.logdir / f"worker{len(self.workers)}.log",
            name=f"c{len(self.workers)}-{uuid.uuid4().hex[:6]}@chaos",
        )
        w.start()
        self.workers.append(w)
        if wait:
            w.wait_ready(self.client, self.prefix)
        return w

    def stop(self) -> None:
        for w in self.workers:
            w.kill()


@pytest.fixture
def fleet(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(redis_url, prefix, tmp_path)
    yield f
    f.stop()


@pytest.fixture
def chaos_settings(redis_url: str, prefix: str, tmp_path: Path) -> Settings:
    return Settings(
        redis_url=redis_url, prefix=prefix, home=tmp_path / "home", lease_seconds=2, owed_grace=1, sweep_interval=0.2
    )


def report(name: str, **figures: Any) -> None:
    print(f"\n[chaos] {name}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))
