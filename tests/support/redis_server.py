"""A private redis-server on a free port, for tests that must not share (or that restart) Redis."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

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
        #: ports this object picked may be picked again if another process bound one first
        self._picked = port is None
        self._started = False
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
        """Start and wait until this process answers. On a first start whose ports this object picked, a port another
        process bound between the pick and the server's bind ("Address already in use") is picked
        again; anything else that stops the server is raised with the end of its log."""
        for _ in range(5):
            if self._start_once():
                self._started = True
                return self
            self._pick_again()
        raise RuntimeError(f"redis-server on port {self.port} did not start: {self._log_tail()}")

    def _start_once(self) -> bool:
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
        with open(self.dir / "redis.out", "ab") as out:  # what it says before its log is open
            proc = self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        client = redis.Redis(
            port=self.port,
            username=self.username,
            password=self.password,
            socket_connect_timeout=0.2,
            socket_timeout=0.5,
            retry=Retry(NoBackoff(), 0),  # each question once: the loop asks again
        )
        deadline = time.monotonic() + 10
        try:
            # answered by this process, not by whatever else listens there while it fails to bind
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    # and has its data loaded: INFO answers while it loads, PING does not
                    if self._answering(client) == proc.pid and client.ping():
                        return True
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                time.sleep(0.02)
        finally:
            client.close()
        if proc.poll() is None:
            raise RuntimeError(f"redis-server on port {self.port} did not answer in 10 s: {self._log_tail()}")
        self.proc = None
        can_pick = self._picked or "--cluster-port" in self.extra
        if self._started or not can_pick or "Address already in use" not in self._log_tail():
            raise RuntimeError(f"redis-server on port {self.port} exited: {self._log_tail()}")
        return False

    def _answering(self, client: redis.Redis) -> int | None:
        """The pid of the server answering on the port (for a user INFO is denied to, the one
        started here, if any answers while it runs)."""
        try:
            return int(client.info("server")["process_id"])
        except redis.ResponseError:
            return self.proc.pid if self.proc is not None and client.ping() else None

    def _pick_again(self) -> None:
        """New ports for a server that could not bind the ones picked (a Cluster's bus port too)."""
        if self._picked:
            self.port = free_port()
        if "--cluster-port" in self.extra:
            self.extra[self.extra.index("--cluster-port") + 1] = str(free_port())

    def _log_tail(self) -> str:
        lines = []
        for name in ("redis.out", "redis.log"):
            with contextlib.suppress(OSError):
                lines += (self.dir / name).read_text(errors="replace").splitlines()[-5:]
        return " | ".join(line for line in lines if line.strip()) or "(nothing logged)"

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
