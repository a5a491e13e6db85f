"""A Redis Sentinel set on free ports for tests: one primary, its replicas and the sentinels
watching them (`redis-server --sentinel`), with short failover timings so a test sees a failover
within seconds. Everything runs as real redis-server processes under one folder."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import redis

from celery_agents.store.embedded import redis_server_binary
from tests.support.redis_server import RedisServer, free_port

MASTER = "agents-main"


class SentinelSet:
    """`replicas` replicas of a primary and `sentinels` sentinels with quorum `quorum`. The primary
    is `servers[0]` until a failover; `master()` asks the sentinels which one it is now."""

    def __init__(
        self,
        directory: Path,
        *,
        replicas: int = 2,
        sentinels: int = 3,
        quorum: int = 2,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 3000,
        appendonly: bool = True,
        password: str | None = None,
        tls: dict[str, Path] | None = None,
        replica_priority: int | None = None,
    ) -> None:
        """`tls`: the `ca`, `cert` and `key` files: servers and sentinels then also listen with TLS
        (replication and the sentinels' own connections go over it), and `url()` names the
        sentinels' TLS ports; the plain ports stay for the test's own clients."""
        self.dir = Path(directory)
        self.password = password
        self.tls = tls
        self.tls_ports: dict[int, int] = {}
        # Debian's Redis 7 where there is one (as deployments run it: no script cache replicated).
        binary = redis_server_binary(("system", "path"))
        self.servers = []
        for i in range(1 + replicas):
            extra = self._auth_args()
            if i and replica_priority is not None:  # 0: the sentinels promote none of them
                extra += ["--replica-priority", str(replica_priority)]
            if tls is not None:
                tls_port = free_port()
                extra += ["--tls-port", str(tls_port), "--tls-replication", "yes", *self._tls_args()]
            server = RedisServer(self.dir / f"redis{i}", appendonly=appendonly, extra=extra, binary=binary)
            if tls is not None:
                self.tls_ports[server.port] = tls_port
            self.servers.append(server)
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        for port in self.sentinel_ports if tls is not None else []:
            self.tls_ports[port] = free_port()
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.sentinel_procs: list[subprocess.Popen[bytes]] = []

    def _tls_args(self) -> list[str]:
        assert self.tls is not None
        return [
            "--tls-cert-file", str(self.tls["cert"]), "--tls-key-file", str(self.tls["key"]),
            "--tls-ca-cert-file", str(self.tls["ca"]), "--tls-auth-clients", "no",
        ]  # fmt: skip

    def _auth_args(self) -> list[str]:
        return ["--requirepass", self.password, "--masterauth", self.password] if self.password else []

    def url(self, db: int = 0, scheme: str = "redis+sentinel") -> str:
        """`AGENTS_REDIS_URL` for this set."""
        auth = f":{self.password}@" if self.password else ""
        hosts = ",".join(f"127.0.0.1:{self.tls_ports.get(p, p)}" for p in self.sentinel_ports)
        if self.tls is None:
            return f"{scheme}://{auth}{hosts}/{MASTER}/{db}"
        return f"rediss+sentinel://{auth}{hosts}/{MASTER}/{db}?ssl_cert_reqs=required&ssl_ca_certs={self.tls['ca']}"

    def _reached(self, port: int) -> int:
        """The port others reach server `port` on: its TLS port when the set speaks TLS."""
        return self.tls_ports.get(port, port)

    def start(self) -> SentinelSet:
        primary, *replicas = self.servers
        primary.start()
        for r in replicas:
            r.start()
            self.admin(r.port).replicaof("127.0.0.1", self._reached(primary.port))
        for r in replicas:
            self._wait(lambda r=r: self.admin(r.port).info("replication")["master_link_status"] == "up", "a replica")
        for port in self.sentinel_ports:
            self.sentinel_procs.append(self._start_sentinel(port, primary.port))
        self._wait(self._sentinels_see_everyone, "the sentinels to see each other and the replicas", timeout=30)
        return self

    def _start_sentinel(self, port: int, primary_port: int) -> subprocess.Popen[bytes]:
        folder = self.dir / f"sentinel{port}"
        folder.mkdir(parents=True, exist_ok=True)
        conf = folder / "sentinel.conf"
        lines = [
            f"port {port}",
            "bind 127.0.0.1",
            f'dir "{folder}"',
            f'logfile "{folder / "sentinel.log"}"',
            f"sentinel monitor {MASTER} 127.0.0.1 {self._reached(primary_port)} {self.quorum}",
            f"sentinel down-after-milliseconds {MASTER} {self.down_after_ms}",
            f"sentinel failover-timeout {MASTER} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {MASTER} 2",
        ]
        if self.password:
            lines.append(f"sentinel auth-pass {MASTER} {self.password}")
        if self.tls is not None:
            args = self._tls_args()
            lines += [f"tls-port {self.tls_ports[port]}", "tls-replication yes"]
            lines += [f"{args[i][2:]} {args[i + 1]}" for i in range(0, len(args), 2)]
        conf.write_text("\n".join(lines) + "\n")
        binary = self.servers[0].binary
        return subprocess.Popen([binary, str(conf), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def sentinel(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, decode_responses=True, socket_timeout=2, socket_connect_timeout=0.5)

    def admin(self, port: int) -> redis.Redis:
        return redis.Redis(
            port=port, password=self.password, decode_responses=True, socket_timeout=5, socket_connect_timeout=0.5
        )

    def _sentinels_see_everyone(self) -> bool:
        want_replicas = len(self.servers) - 1
        for port in self.sentinel_ports:
            try:
                state = self.sentinel(port).sentinel_master(MASTER)
            except (redis.ConnectionError, redis.ResponseError):
                return False
            others = int(state.get("num-other-sentinels", 0))
            if others < len(self.sentinel_ports) - 1 or int(state.get("num-slaves", 0)) < want_replicas:
                return False
        return True

    def master_port(self) -> int | None:
        """The primary's port as a majority of the reachable sentinels name it."""
        seen: dict[int, int] = {}
        for port in self.sentinel_ports:
            with contextlib.suppress(redis.ConnectionError, redis.ResponseError, redis.TimeoutError):
                _, master = self.sentinel(port).sentinel_get_master_addr_by_name(MASTER)
                plain = {tls: p for p, tls in self.tls_ports.items()}.get(int(master), int(master))
                seen[plain] = seen.get(plain, 0) + 1
        best = max(seen.items(), key=lambda kv: kv[1], default=None)
        return best[0] if best and best[1] >= self.quorum else None

    def server_on(self, port: int) -> RedisServer:
        return next(s for s in self.servers if s.port == port)

    def kill_master(self) -> RedisServer:
        """SIGKILL the current primary (no shutdown, no final write); returns it."""
        port = self.master_port()
        assert port is not None, "the sentinels agree on no primary"
        server = self.server_on(port)
        server.stop(kill=True)
        return server

    def wait_failover(self, old_port: int, timeout: float = 60) -> int:
        """Until the sentinels name another primary and it answers as one; its port."""

        def promoted() -> int | None:
            port = self.master_port()
            if port is None or port == old_port:
                return None
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                if self.admin(port).info("replication")["role"] == "master":
                    return port
            return None

        return int(self._wait(promoted, "the sentinels to promote a replica", timeout=timeout))

    def _wait(self, predicate, what: str, timeout: float = 20):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                value = predicate()
                if value:
                    return value
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def stop(self) -> None:
        for proc in self.sentinel_procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        self.sentinel_procs = []
        for s in self.servers:
            s.stop(kill=True)
