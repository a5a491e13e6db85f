"""Shared fixtures: real Redis (a private server per test session), isolated key prefixes, the
scripted model server, agent files, clients, stores (real Redis and fakeredis).

Worker processes (real `agents worker`s), cheapest first — keep the suite well under 10 minutes:
- `tests.support.workers.Worker(env, ...)`: one worker. It is forked from the run's warm launcher
  (tests/support/launcher.py: litellm, Celery... imported once per run), so a start costs ~2 s of
  CPU instead of ~10 s; `fork=False` execs a fresh interpreter (tests of the worker's own start or
  of what its /proc environ shows). Give it `worker_env(redis_url, prefix, **AGENTS_settings)`;
  a new prefix keeps a module's data apart on the one private Redis.
- e2e (`tests/e2e/conftest.py`): `workers`, two workers shared by a module (`module_prefix`,
  `module_settings`); `start_workers(...)` for a module fixture of your own configuration.
- cli (`tests/cli/conftest.py`): `cli_worker`, one worker for the whole package (`cli_prefix`).
- chaos (`tests/chaos/conftest.py`): `fleet`, workers started and SIGKILLed by one test.
Share a fleet across a module (scope="module") whenever tests do not kill or reconfigure it, start
workers together and wait for them after (`start_workers`), and wait on Redis (`wait_for` on a
key) rather than sleeping.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_agents.config import Settings
from celery_agents.store import Store, client_for_url
from tests.support.llm_server import LlmServer
from tests.support.redis_server import RedisServer

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("AGENTS_LLM_BACKOFF", "0.01")
for _k in ("AGENTS_REDIS_URL", "AGENTS_BROKER_URL", "AGENTS_PREFIX", "AGENTS_HOME"):
    os.environ.pop(_k, None)

ROOT = Path(__file__).resolve().parent.parent


#: The files that take longest (seconds of a 2-core run at -n 4), run first: pytest-xdist hands
#: files out in collection order (`--no-loadscope-reorder`), and one of these started last would
#: keep the whole run waiting on it alone. A file missing here only runs later, in its usual place.
LONGEST_FILES = (
    # wall time in a full `-n 4` run on 2 cores
    "tests/bench/test_bench_smoke.py",  # ~180 s
    "tests/e2e/test_no_leaks.py",  # ~155 s
    "tests/chaos/test_load.py",  # ~120 s
    "tests/tools/test_trust_e2e.py",  # ~110 s with its workers' start
    "tests/chaos/test_many_in_flight.py",  # ~70 s
    "tests/cli/test_interrupt.py",  # ~45 s
    "tests/tools/mcp/test_calls.py",  # ~40 s
    "tests/cli/test_retention.py",  # ~35 s
    "tests/chaos/test_worker_availability.py",  # ~32 s
    "tests/e2e/test_secured_redis.py",
    "tests/cli/test_errors.py",
    "tests/chaos/test_redis_restart.py",
    "tests/chaos/test_zombie.py",
    "tests/chaos/test_clock_skew.py",
    "tests/cli/test_fast_start.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first, then the files with tests marked `slow`, then the rest, each group
    in collection order: the same order in every xdist process (it must be)."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    slow_files = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}

    def key(item: pytest.Item) -> tuple[int, int]:
        path = item.nodeid.split("::")[0]
        if path in rank:
            return 0, rank[path]
        return (1 if path in slow_files else 2), 0

    items.sort(key=key)  # stable: collection order within each group


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A private redis-server for the whole test run (AOF off)."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop(kill=True)


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def tooldir() -> Iterator[Path]:
    """A folder every uid can read (pytest's tmp_path is 0700): sandboxed tools run from here."""
    path = Path(tempfile.mkdtemp(prefix="agents-tooltest-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def settings(redis_url: str, prefix: str, tmp_path: Path) -> Settings:
    return Settings(redis_url=redis_url, prefix=prefix, home=tmp_path / "home", sweep_interval=0.2, owed_grace=2.0)


@pytest.fixture
def rclient(redis_url: str) -> Iterator[redis.Redis]:
    client = client_for_url(redis_url)
    yield client
    client.close()


@pytest.fixture(params=["redis", "fakeredis"])
def any_store(request: pytest.FixtureRequest, settings: Settings) -> Iterator[Store]:
    """A Store on real Redis, and the same on fakeredis[lua]."""
    if request.param == "redis":
        client = client_for_url(settings.redis_url or "")
    else:
        fakeredis = pytest.importorskip("fakeredis")
        client = fakeredis.FakeRedis(decode_responses=True)
    yield Store(client, settings)
    client.close()


@pytest.fixture
def store(settings: Settings) -> Iterator[Store]:
    """A Store on the real Redis."""
    client = client_for_url(settings.redis_url or "")
    yield Store(client, settings)
    client.close()


@pytest.fixture
def stores(store: Store) -> Any:
    """Make more Stores, each with its own connection pool, on the same real Redis (racing workers)."""
    made: list[Store] = []

    def make() -> Store:
        s = Store(client_for_url(store.settings.redis_url or ""), store.settings)
        made.append(s)
        return s

    yield make
    for s in made:
        s.client.close()


@pytest.fixture(scope="session")
def llm_server() -> Iterator[LlmServer]:
    server = LlmServer().start()
    yield server
    server.stop()


@pytest.fixture
def write_agent(tmp_path: Path) -> Any:
    """Write an agent file; returns its path."""

    def write(agent: dict[str, Any], name: str = "agent.json") -> Path:
        path = tmp_path / name
        path.write_text(json.dumps(agent))
        return path

    return write


def agent_dict(model: str, api_base: str | None = None, **extra: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"slug": "test-agent", "model": model}
    if api_base:
        data["apiBase"] = api_base
    data.update(extra)
    return data
