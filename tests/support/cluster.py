"""A Redis Cluster on free ports for tests: 3 primaries, each with a replica (`redis-server
--cluster-enabled yes`, joined with `redis-cli --cluster create`), with a short node timeout so
that a replica takes over a killed primary within seconds. Everything runs as real redis-server
processes under one folder; `reshard` and `kill_primary` are what the chaos tests do to it."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import redis

from celery_agents.store.embedded import redis_server_binary
from tests.support.redis_server import RedisServer, free_port


def redis_cli() -> str:
    """redis-cli beside the redis-server the cluster runs (Debian's, else the one on PATH)."""
    for candidate in ("/usr/bin/redis-cli", shutil.which("redis-cli")):
        if candidate and Path(candidate).exists():
            return candidate
    raise RuntimeError("no redis-cli found")


class RedisCluster:
    """`primaries` primaries with `replicas` replicas each."""

    def __init__(self, directory: Path, *, primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        self.dir = Path(directory)
        self.primaries = primaries
        self.replicas = replicas
        binary = redis_server_binary(("system", "path"))
        self.servers: list[RedisServer] = []
        for i in range(primaries * (1 + replicas)):
            folder = self.dir / f"node{i}"
            extra = [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(folder / "nodes.conf"),
                "--cluster-node-timeout", str(node_timeout_ms),
                # the bus port named, not the default port + 10000 (which may be taken or > 65535)
                "--cluster-port", str(free_port()),
                # a replica that lost its primary a while ago still takes over (tests kill quickly)
                "--cluster-replica-validity-factor", "0",
            ]  # fmt: skip
            self.servers.append(RedisServer(folder, appendonly=True, extra=extra, binary=binary))

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers]

    def url(self, scheme: str = "redis+cluster") -> str:
        """`AGENTS_REDIS_URL` for this cluster (every node named: any one that answers will do)."""
        return f"{scheme}://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self) -> RedisCluster:
        for s in self.servers:
            s.start()
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        self._cli("--cluster", "create", *nodes, "--cluster-replicas", str(self.replicas), "--cluster-yes")
        self.wait(self._healthy, "the cluster to agree on every slot", timeout=30)
        return self

    def _cli(self, *args: str, timeout: float = 120) -> str:
        out = subprocess.run(
            [redis_cli(), *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli {' '.join(args)} failed: {out.stdout[-2000:]} {out.stderr[-2000:]}")
        return out.stdout

    def admin(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, decode_responses=True, socket_timeout=5, socket_connect_timeout=0.5)

    def _healthy(self) -> bool:
        """Every live node sees every slot served, and every replica is in sync with its primary."""
        for s in self.servers:
            if s.proc is None:
                continue
            admin = self.admin(s.port)
            info = admin.cluster("info")
            if info.get("cluster_state") != "ok" or int(info.get("cluster_slots_ok", 0)) != 16384:
                return False
            replication = admin.info("replication")
            if replication["role"] == "slave" and replication.get("master_link_status") != "up":
                return False
        return True

    def nodes(self, port: int | None = None) -> list[dict[str, Any]]:
        """CLUSTER NODES as one live node sees it: id, port, role, slots."""
        port = port or next(s.port for s in self.servers if s.proc is not None)
        out = []
        for address, node in self.admin(port).cluster("nodes").items():
            flags = node["flags"].split(",")
            out.append(
                {
                    "id": node["node_id"],
                    "port": int(address.rsplit(":", 1)[1].split("@")[0]),
                    "role": "primary" if "master" in flags else "replica",
                    "failed": "fail" in flags or "fail?" in flags,
                    "slots": [(int(span[0]), int(span[1])) for span in node["slots"]],
                }
            )
        return out

    def owner(self, slot: int) -> int:
        """The port of the primary serving `slot`."""
        for node in self.nodes():
            if node["role"] != "primary" or node["failed"]:
                continue
            if any(lo <= slot <= hi for lo, hi in node["slots"]):
                return int(node["port"])
        raise AssertionError(f"no primary serves slot {slot}")

    def node_id(self, port: int) -> str:
        return str(self.admin(port).execute_command("CLUSTER MYID"))

    def reshard(self, from_port: int, to_port: int, slots: int) -> str:
        """`redis-cli --cluster reshard`: move `slots` slots (the lowest of `from_port`'s) and their
        keys to `to_port`, live."""
        return self._cli(
            "--cluster", "reshard", f"127.0.0.1:{from_port}",
            "--cluster-from", self.node_id(from_port), "--cluster-to", self.node_id(to_port),
            "--cluster-slots", str(slots), "--cluster-yes", "--cluster-pipeline", "100",
        )  # fmt: skip

    def migrate_slot(self, slot: int, to_port: int, batch: int = 10) -> int:
        """Move one slot and its keys to the primary on `to_port`, live, as `redis-cli --cluster
        reshard` does for each slot (IMPORTING, MIGRATING, MIGRATE in batches, NODE on every
        primary); returns how many keys moved. Meanwhile clients get ASK and TRYAGAIN."""
        from_port = self.owner(slot)
        if from_port == to_port:
            return 0
        src, dst = self.admin(from_port), self.admin(to_port)
        src_id, dst_id = self.node_id(from_port), self.node_id(to_port)
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        moved = 0
        while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch):
            src.execute_command("MIGRATE", "127.0.0.1", to_port, "", 0, 5000, "KEYS", *keys)
            moved += len(keys)
        for node in self.nodes():
            if node["role"] == "primary" and not node["failed"]:
                self.admin(node["port"]).execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        self.wait(lambda: self._agree(slot, to_port), f"every node to see slot {slot} on {to_port}")
        return moved

    def _agree(self, slot: int, port: int) -> bool:
        return (
            all(self.owner_seen_by(s.port, slot) == port for s in self.servers if s.proc is not None)
            and self._healthy()
        )

    def owner_seen_by(self, seer: int, slot: int) -> int | None:
        for node in self.nodes(seer):
            if node["role"] == "primary" and any(lo <= slot <= hi for lo, hi in node["slots"]):
                return int(node["port"])
        return None

    def server(self, port: int) -> RedisServer:
        return next(s for s in self.servers if s.port == port)

    def kill(self, port: int) -> None:
        """SIGKILL the node on `port` (no shutdown, no final write)."""
        self.server(port).stop(kill=True)

    def wait_promoted(self, old_port: int, slot: int, timeout: float = 60) -> int:
        """Until another node serves `slot` as primary (its replica took over); its port."""

        def promoted() -> int | None:
            port = self.owner(slot)
            return port if port != old_port and self.admin(port).info("replication")["role"] == "master" else None

        return int(self.wait(promoted, "a replica to take over", timeout=timeout))

    def wait(self, predicate, what: str, timeout: float = 20):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError, redis.ResponseError, AssertionError):
                value = predicate()
                if value:
                    return value
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def stop(self) -> None:
        for s in self.servers:
            s.stop(kill=True)
