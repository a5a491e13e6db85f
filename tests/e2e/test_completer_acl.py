"""docker-compose.yml's Redis users, on a real redis-server started with exactly the user
directives the compose file gives it: the `workers` user runs a session through a real worker;
the `completer` user XADDs a completion that the worker applies, and can do nothing else — not
read the stream, not write any other key, not run scripts, not publish, not even PING."""

from __future__ import annotations

import json
import re
import secrets
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from celery_agents import Client
from celery_agents.config import Settings
from tests.cli.process import DEMO_AGENT, ROOT
from tests.e2e.conftest import wait_for
from tests.support.redis_server import free_port
from tests.support.workers import Worker, worker_env

pytestmark = pytest.mark.slow

PREFIX = "agents"  # the prefix the compose file's completer ACL names


def compose_users(passwords: dict[str, str]) -> list[str]:
    """The `--user ...` arguments of the compose file's redis-server, passwords filled in."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    command: list[str] = services["redis"]["command"]
    users = command[command.index("--user") :]
    return [re.sub(r"\$\{(\w+)(:\?[^}]*)?\}", lambda m: passwords[m.group(1)], arg) for arg in users]


@dataclass
class AclRedis:
    port: int
    passwords: dict[str, str]

    def url(self, user: str) -> str:
        return f"redis://{user}:{self.passwords[user]}@127.0.0.1:{self.port}/0"

    def client(self, user: str) -> redis.Redis:
        return redis.Redis.from_url(self.url(user), decode_responses=True)


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclRedis]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("needs redis-server")
    folder = tmp_path_factory.mktemp("acl-redis")
    passwords = {"AGENTS_WORKERS_PASSWORD": secrets.token_hex(16), "AGENTS_COMPLETER_PASSWORD": secrets.token_hex(16)}
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(folder), *compose_users(passwords)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    server = AclRedis(
        port,
        {"workers": passwords["AGENTS_WORKERS_PASSWORD"], "completer": passwords["AGENTS_COMPLETER_PASSWORD"]},
    )
    deadline = time.monotonic() + 15
    while True:
        try:
            server.client("workers").ping()
            break
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    try:
        yield server
    finally:
        proc.kill()
        proc.wait(timeout=10)


FORBIDDEN: list[tuple[Any, ...]] = [
    ("PING",),
    ("GET", f"{PREFIX}:completions"),
    ("XRANGE", f"{PREFIX}:completions", "-", "+"),
    ("XREADGROUP", "GROUP", "celery-agents", "me", "STREAMS", f"{PREFIX}:completions", ">"),
    ("XDEL", f"{PREFIX}:completions", "0-1"),
    ("DEL", f"{PREFIX}:completions"),
    ("XADD", f"{PREFIX}:completions:rejected", "*", "token", "t"),
    ("XADD", f"{PREFIX}:elsewhere", "*", "token", "t"),
    ("SET", f"{PREFIX}:agent:evil", "{}"),
    ("HSET", f"{PREFIX}:s:{{x}}:meta", "status", "active"),
    ("ZADD", f"{PREFIX}:owed", "0", "x"),
    ("LPUSH", "steps", "message"),
    ("KEYS", "*"),
    ("SCAN", "0"),
    ("EVAL", "return 1", "0"),
    ("PUBLISH", "channel", "message"),
    ("CONFIG", "GET", "*"),
    ("ACL", "WHOAMI"),
    ("FLUSHALL",),
]


def test_the_completer_can_complete_a_call_and_nothing_else(acl_redis: AclRedis, tmp_path: Path) -> None:
    worker = Worker(
        worker_env(acl_redis.url("workers"), PREFIX, tmp_path / "home"),
        log=tmp_path / "worker.log",
        name=f"acl-{uuid.uuid4().hex[:6]}@test",
    ).start()
    try:
        workers_client = acl_redis.client("workers")
        worker.wait_ready(workers_client, PREFIX)
        settings = Settings(redis_url=acl_redis.url("workers"), prefix=PREFIX, home=tmp_path / "home")
        with Client(settings) as client:
            view = client.start(DEMO_AGENT, "Please book a table in Paris.", run=True, timeout=60)
            [pending] = view.pending
            completer = acl_redis.client("completer")
            for command in FORBIDDEN:
                with pytest.raises(redis.exceptions.NoPermissionError):
                    completer.execute_command(*command)
            completer.xadd(f"{PREFIX}:completions", {"token": pending.token, "result": json.dumps("booked")})
            done = wait_for(
                lambda: (v := client.view(view.session_id)).state.value == "completed" and v,
                timeout=60,
                what="the worker to apply the completer's entry",
            )
        assert "booked" in (done.response or "")
        assert workers_client.xlen(f"{PREFIX}:completions") == 0, "the entry was applied and removed"
    finally:
        worker.stop()
