"""The throughput phase on a local Redis Cluster (`python bench/run.py --cluster`).

Starts 3 primaries with a replica each (`redis-server --cluster-enabled yes`, joined by
`redis-cli --cluster create`; no persistence, as the single server of the other phases) and a
private redis-server for the queues (`AGENTS_BROKER_URL`: Celery's queues cannot live on a
Cluster), runs `agents worker` with the same step processes as phase 3 on it, and measures steps
committed per second across many sessions exactly as phase 3 does on one Redis: the demo model
answering at once, one step per session, the first step of each published at once. Writes wait
for one replica (WAIT 1, the default on a Cluster, as on Sentinel), which one Redis without
replicas does not: `cluster_vs_single_steps_per_s` is the cost of the Cluster as deployed, not
of the key layout alone.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from typing import Any

import redis

from bench.harness import Agents, Sizes, wait_until
from bench.processes import Processes, agents_env, free_port, redis_server_binary, wait_heartbeat


def redis_cli() -> str:
    return str(redis_server_binary()).replace("redis-server", "redis-cli")


def start_cluster(procs: Processes, primaries: int = 3, replicas: int = 1) -> str:
    """The cluster's `redis+cluster://` URL, once every slot is served and every replica in sync."""
    ports = []
    for i in range(primaries * (1 + replicas)):
        port, bus = free_port(), free_port()
        data = procs.dir / f"cluster{i}"
        data.mkdir(exist_ok=True)
        procs.start(
            f"cluster{i}",
            [
                redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(data), "--maxmemory-policy", "noeviction",
                "--cluster-enabled", "yes", "--cluster-config-file", str(data / "nodes.conf"),
                "--cluster-port", str(bus), "--protected-mode", "no",
            ],
        )  # fmt: skip
        ports.append(port)
    for port in ports:
        client = redis.Redis(port=port, socket_connect_timeout=0.2)
        wait_until(lambda client=client: _pings(client), 10, f"redis-server on {port}")
        client.close()
    nodes = [f"127.0.0.1:{p}" for p in ports]
    subprocess.run(
        [redis_cli(), "--cluster", "create", *nodes, "--cluster-replicas", str(replicas), "--cluster-yes"],
        check=True,
        capture_output=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    admins = [redis.Redis(port=p, decode_responses=True, socket_timeout=5) for p in ports]
    wait_until(lambda: all(_ready(a) for a in admins), 60, "the cluster to serve every slot")
    for a in admins:
        a.close()
    return "redis+cluster://" + ",".join(nodes)


def _pings(client: redis.Redis) -> bool:
    with contextlib.suppress(redis.ConnectionError):
        return bool(client.ping())
    return False


def _ready(admin: redis.Redis) -> bool:
    info = admin.cluster("info")
    if info.get("cluster_state") != "ok" or int(info.get("cluster_slots_ok", 0)) != 16384:
        return False
    replication = admin.info("replication")
    return replication["role"] != "slave" or replication.get("master_link_status") == "up"


def bench_cluster(procs: Processes, prefix: str, workers: int, sizes: Sizes) -> dict[str, Any]:
    url = start_cluster(procs)
    out = throughput(procs, url, procs.redis_server(), prefix, workers, sizes, "cluster")
    return {
        "cluster_steps_per_s": out["steps_per_s"],
        "cluster_index_shards": out["index_shards"],
        "cluster_shards_used": out["shards_used"],
        "cluster_ack_replicas": out["ack_replicas"],
    }


def throughput(
    procs: Processes, url: str, broker: str | None, prefix: str, workers: int, sizes: Sizes, tag: str
) -> dict[str, Any]:
    """Steps committed per second across `sizes.throughput` sessions of one step each, as phase 3
    measures them, on the state Redis at `url` (one server or a Cluster) and the queues at
    `broker` (None: the state Redis)."""
    agents = Agents(url, prefix, broker=broker)
    name = f"{tag}-{prefix}@bench"
    extra = {"AGENTS_BROKER_URL": broker} if broker else {}
    worker = procs.agents_worker(agents_env(url, prefix, **extra), workers, name)
    shards = agents.store.keys.all_shards()

    def count(state: str) -> int:
        return sum(int(agents.client.zcard(k.state_index(state))) for k in shards)

    try:
        wait_heartbeat(agents.client, prefix, name, worker)
        warm = agents.create(sizes.warmup, agent=agents.step_agent, text="Hello")
        for sid in warm:
            agents.step_roundtrip(sid)
        n = sizes.throughput
        sids = agents.create(n, agent=agents.step_agent, text="Hello")
        done_before = count("completed")
        t0 = time.perf_counter()
        for sid in sids:
            agents.dispatcher.step(sid, 1, "bench")
        wait_until(lambda: count("completed") - done_before >= n, 600, f"{n} steps ({tag})")
        elapsed = time.perf_counter() - t0
        if count("failed"):
            raise RuntimeError(f"{count('failed')} sessions failed during the {tag} throughput run")
        return {
            "steps_per_s": n / elapsed,
            "index_shards": len(shards),
            "shards_used": len({agents.store.keys.shard_of(s) for s in sids}),
            "ack_replicas": agents.store.acks.replicas,
        }
    finally:
        procs.stop(worker, name)
        agents.close()
