"""End-to-end fixtures: real worker processes on the private Redis, shared per test module."""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_agents.config import Settings
from tests.support.workers import Worker, stop_all, worker_env

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "tests" / "support" / "tools" / "record.py"


@pytest.fixture(scope="module")
def module_prefix() -> str:
    return f"e{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def module_settings(redis_url: str, module_prefix: str, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return Settings(
        redis_url=redis_url,
        prefix=module_prefix,
        home=tmp_path_factory.mktemp("home"),
        sweep_interval=0.2,
        owed_grace=2.0,
    )


def start_workers(
    redis_url: str,
    prefix: str,
    logdir: Path,
    count: int = 1,
    concurrency: int = 2,
    queues: str = "steps,tools,isolated",
    step_threads: int | None = None,
    **env: str,
) -> list[Worker]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    workers = [
        Worker(
            worker_env(redis_url, prefix, **env),
            queues=queues,
            concurrency=concurrency,
            log=logdir / f"worker{i}.log",
            name=f"w{i}-{uuid.uuid4().hex[:6]}@test",
            step_threads=step_threads,
        ).start()
        for i in range(count)
    ]
    try:
        for w in workers:
            w.wait_ready(client, prefix)
    except Exception:
        for w in workers:
            w.kill()
        raise
    return workers


def record_tool(name: str, log: Path, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "description": f"records its runs ({name})",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}, "sleep": {"type": "number"}}},
        "command": [sys.executable, str(RECORD), str(log), name],
        **extra,
    }


def runs(log: Path, tool: str | None = None, phase: str = "end") -> list[dict[str, Any]]:
    if not log.exists():
        return []
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["phase"] == phase and (tool is None or r["tool"] == tool)]


def wait_for(predicate: Callable[[], Any], timeout: float = 30, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def workers(redis_url: str, module_prefix: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Worker]]:
    """Two worker processes (one pool process each): a step message can race between them."""
    logdir = tmp_path_factory.mktemp("logs")
    ws = start_workers(redis_url, module_prefix, logdir, count=2, concurrency=1)
    yield ws
    stop_all(ws)
