"""docker-compose.sentinel.yml on real processes: its three Redis servers started with exactly the
arguments and users the file gives them, its three sentinels with its configuration (ports and
hosts made local, the failover timings shortened), and a worker on the file's `redis+sentinel://`
URL. A session waits on a deferred call; the primary is killed; the sentinels (with the file's
`sentinel` user) promote a replica (which replicated with the file's `replica` user); the
`completer` user completes the call on the new primary and the worker finishes the session."""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.store.embedded import redis_server_binary
from tests.cli.process import DEMO_AGENT, ROOT
from tests.e2e.conftest import wait_for
from tests.support.redis_server import free_port
from tests.support.workers import Worker, worker_env

pytestmark = pytest.mark.slow

COMPOSE = ROOT / "docker-compose.sentinel.yml"
SERVERS = ("redis", "redis-replica-1", "redis-replica-2")
SENTINELS = ("sentinel-1", "sentinel-2", "sentinel-3")
PREFIX = "agents"  # the prefix the compose file's completer ACL names


def _fill(text: str, values: dict[str, str]) -> str:
    """Compose's `${NAME:?message}` (and the shell's `$NAME`, written `$$NAME`) filled in."""
    text = re.sub(r"\$\{(\w+)(:\?[^}]*)?\}", lambda m: values[m.group(1)], text)
    return re.sub(r"\$\$(\w+)", lambda m: values[m.group(1)], text)


@dataclass
class ComposeSet:
    folder: Path
    passwords: dict[str, str]
    ports: dict[str, int]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def local(self, text: str) -> str:
        """A compose host:port (`redis 6379`, `sentinel-1:26379`) as this machine's."""
        for name, port in sorted(self.ports.items(), key=lambda kv: -len(kv[0])):
            text = re.sub(rf"(?<![\w-]){re.escape(name)}([ :])(6379|26379)\b", f"127.0.0.1\\g<1>{port}", text)
        return text

    def admin(self, name: str, user: str = "workers") -> redis.Redis:
        password = self.passwords["AGENTS_WORKERS_PASSWORD" if user == "workers" else "AGENTS_COMPLETER_PASSWORD"]
        return redis.Redis(port=self.ports[name], username=user, password=password, decode_responses=True)

    def primary(self) -> str:
        _, port = redis.Redis(port=self.ports["sentinel-1"]).sentinel_get_master_addr_by_name("agents-main")
        return next(n for n in SERVERS if self.ports[n] == int(port))

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def compose_set(tmp_path: Path) -> Iterator[ComposeSet]:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    names = [f"AGENTS_{user}_PASSWORD" for user in ("WORKERS", "COMPLETER", "REPLICA", "SENTINEL")]
    cs = ComposeSet(tmp_path, {n: secrets.token_hex(16) for n in names}, {n: free_port() for n in SERVERS + SENTINELS})
    binary = redis_server_binary(("system", "path"))
    try:
        for name in SERVERS:
            args = [_fill(a, cs.passwords) for a in services[name]["command"]]
            if "--replicaof" in args:
                at = args.index("--replicaof")
                assert args[at + 2] == "6379"
                args[at + 1 : at + 3] = ["127.0.0.1", str(cs.ports[args[at + 1]])]
            args = [a if a not in SERVERS else "127.0.0.1" for a in args]  # --replica-announce-ip
            folder = tmp_path / name
            folder.mkdir()
            local = ["--port", str(cs.ports[name]), "--bind", "127.0.0.1", "--dir", str(folder)]
            cs.procs[name] = subprocess.Popen([binary, *local, *args[1:]], stdout=subprocess.DEVNULL)
        for name in SERVERS:
            wait_for(lambda n=name: _answers(cs.admin(n)), what=f"{name} to start")
        for name in SERVERS[1:]:
            synced = lambda n=name: cs.admin(n).info("replication")["master_link_status"] == "up"  # noqa: E731
            wait_for(synced, what=f"{name} to sync")
        for name in SENTINELS:
            script = services[name]["command"][2]
            conf = _fill(script.split("<<EOF\n", 1)[1].split("\nEOF", 1)[0], cs.passwords)
            conf = cs.local(conf).replace("port 26379", f"port {cs.ports[name]}")
            conf = re.sub(r"down-after-milliseconds (\S+) \d+", r"down-after-milliseconds \1 1000", conf)
            conf = re.sub(r"failover-timeout (\S+) \d+", r"failover-timeout \1 3000", conf)
            folder = tmp_path / name
            folder.mkdir()
            (folder / "sentinel.conf").write_text(f'dir "{folder}"\nbind 127.0.0.1\n{conf}\n')
            cs.procs[name] = subprocess.Popen(
                [binary, str(folder / "sentinel.conf"), "--sentinel"], stdout=subprocess.DEVNULL
            )
        wait_for(lambda: _sentinels_ready(cs), timeout=30, what="the sentinels to see each other and the replicas")
        yield cs
    finally:
        cs.stop()


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def _sentinels_ready(cs: ComposeSet) -> bool:
    for name in SENTINELS:
        try:
            state = redis.Redis(port=cs.ports[name], decode_responses=True).sentinel_master("agents-main")
        except (redis.ConnectionError, redis.ResponseError):
            return False
        if int(state["num-other-sentinels"]) < 2 or int(state["num-slaves"]) < 2:
            return False
    return True


def test_the_compose_files_sentinel_set_fails_over_and_the_session_completes(
    compose_set: ComposeSet, tmp_path: Path
) -> None:
    services: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())["services"]
    url = compose_set.local(_fill(services["workers"]["environment"]["AGENTS_REDIS_URL"], compose_set.passwords))
    assert url.startswith("redis+sentinel://workers:")
    worker = Worker(
        worker_env(url, PREFIX, tmp_path / "home"), log=tmp_path / "worker.log", name=f"cs-{uuid.uuid4().hex[:6]}@test"
    ).start()
    try:
        worker.wait_ready(compose_set.admin("redis"), PREFIX)
        with Client(Settings(redis_url=url, prefix=PREFIX, home=tmp_path / "home")) as client:
            view = client.start(DEMO_AGENT, "Please book a table in Paris.", run=True, timeout=60)
            [pending] = view.pending
            old = compose_set.primary()
            compose_set.procs[old].kill()
            new = wait_for(lambda: (p := compose_set.primary()) != old and p, timeout=60, what="a promotion")
            completer = compose_set.admin(new, user="completer")
            completer.xadd(f"{PREFIX}:completions", {"token": pending.token, "result": json.dumps("booked")})
            done = wait_for(
                lambda: (v := client.view(view.session_id)).state.value == "completed" and v,
                timeout=90,
                what="the worker to apply the completion on the new primary",
            )
        assert "booked" in (done.response or "")
        # The sentinels point the other replica at the promoted one after the promotion (and it
        # syncs from it): seconds on a loaded machine, so waited for, not read once.
        wait_for(
            lambda: compose_set.admin(new).info("replication")["connected_slaves"] == 1,
            timeout=60,
            what="the other replica to follow the promoted one",
        )
    finally:
        worker.stop()
