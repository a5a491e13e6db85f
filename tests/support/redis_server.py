"""A private redis-server on a free port, for tests that must not share (or that restart) Redis."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

import redis

from celery_agents.store.embedded import redis_server_binary
from tests.support.ports import free_port


class RedisServer:
    def __init__(
        self,
        directory: Path,
        *,
        appendonly: bool = False,
        appendfsync: str = "everysec",
        port: int | None = None,
        binary: str | None = None,
        extra: list[str] | None = None,
        auth: tuple[str, str] | None = None,
    ) -> None:
        """`auth`: (user, password) this object's own clients log in with (ACL users in `extra`)."""
        self.dir = Path(directory)
        self.binary = binary or redis_server_binary(("path", "system"))
        self.port = port or free_port()
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        #: more `--option value` arguments (a password, a replica's `--masterauth`...)
        self.extra = list(extra or [])
        self.password = self.extra[self.extra.index("--requirepass") + 1] if "--requirepass" in self.extra else None
        self.username: str | None = None
        if auth is not None:
            self.username, self.password = auth
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.dir.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--dir",
            str(self.dir),
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.appendfsync,
            "--maxmemory-policy",
            "noeviction",
            "--logfile",
            str(self.dir / "redis.log"),
            *self.extra,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, username=self.username, password=self.password, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if client.ping():
                    client.close()
                    return self
            except redis.ConnectionError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def stop(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        else:
            with contextlib.suppress(redis.ConnectionError):
                redis.Redis(port=self.port, username=self.username, password=self.password).shutdown(
                    nosave=not self.appendonly
                )
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def __del__(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, 9)
