"""Session state on a Redis Cluster (3 primaries, a replica each, started here on free ports), the
queues on RabbitMQ (`AGENTS_BROKER_URL`): the whole flow through real workers and the CLI, the
completions protocol through the stream each pending call names, listings over every shard, and a
worker that refuses to start on a Cluster without a broker."""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_agents.config import Settings
from celery_agents.model.slots import key_slot, tag_slot
from celery_agents.store import Store, client_for_url
from tests.chaos.invariants import check_invariants
from tests.cli.process import DEMO_AGENT, agents, cli_env, poll
from tests.support.cluster import RedisCluster
from tests.support.redis_server import RedisServer
from tests.support.workers import Worker, worker_env

pytestmark = pytest.mark.slow

AMQP = "amqp://guest:guest@127.0.0.1:5672"
PROMPT = "What is the weather in Paris? Please book a table in Paris."


def _rabbitmqctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["rabbitmqctl", *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    c = RedisCluster(tmp_path_factory.mktemp("cluster")).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A RabbitMQ virtual host of its own; a private Redis where there is no RabbitMQ."""
    vhost = f"celery-agents-cluster-{uuid.uuid4().hex[:8]}"
    if shutil.which("rabbitmqctl") is not None and _rabbitmqctl("add_vhost", vhost).returncode == 0:
        try:
            _rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
            yield f"{AMQP}/{vhost}"
        finally:
            _rabbitmqctl("delete_vhost", vhost)
        return
    server = RedisServer(tmp_path_factory.mktemp("broker")).start()
    yield server.url
    server.stop(kill=True)


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"cl{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def worker(
    cluster: RedisCluster, broker: str, prefix: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    home = tmp_path_factory.mktemp("home")
    env = worker_env(cluster.url(), prefix, home, AGENTS_BROKER_URL=broker)
    w = Worker(env, log=home / "worker.log", name=f"cluster-{prefix}@test").start()
    state = client_for_url(cluster.url())
    try:
        w.wait_ready(state, prefix)
        yield w
    finally:
        w.stop()
        state.close()


@pytest.fixture
def store(cluster: RedisCluster, prefix: str) -> Iterator[Store]:
    s = Store(client_for_url(cluster.url()), Settings(redis_url=cluster.url(), prefix=prefix))
    yield s
    s.client.close()


@pytest.fixture
def cli(cluster: RedisCluster, broker: str, prefix: str, tmp_path: Path) -> dict[str, str]:
    return cli_env(cluster.url(), prefix, tmp_path / "home", AGENTS_BROKER_URL=broker)


def test_a_session_runs_on_the_cluster_and_completes_through_its_stream(
    worker: Worker, store: Store, cli: dict[str, str], cluster: RedisCluster
) -> None:
    started = agents("session", "start", "--agent-file", DEMO_AGENT, "-p", PROMPT, "--run", "--json", env=cli)
    assert started.returncode == 0 and started.doc["state"] == "waiting", started
    sid = started.doc["session_id"]
    [pending] = started.doc["pending"]
    shard = store.keys.for_session(sid)
    assert pending["stream"] == shard.completions, "the pending call names its shard's completions stream"
    assert key_slot(pending["stream"]) == tag_slot(sid), "the stream shares the session's slot"
    listed = agents("session", "pending", "--json", env=cli).doc["pending"]
    assert [p["stream"] for p in listed] == [pending["stream"]]

    # Another system completes it through Redis alone: XADD to the stream the pending call names.
    store.client.xadd(pending["stream"], {"token": pending["token"], "result": json.dumps("booked for 8pm")})
    done = poll(
        lambda: (v := agents("session", "show", sid, "--json", env=cli).doc)["state"] == "completed" and v,
        "the session to complete",
    )
    assert "booked for 8pm" in done["response"] and "Right now in Paris" in done["response"]
    check_invariants(store, sid)
    listing = agents("session", "list", "--json", env=cli).doc["sessions"]
    assert sid in [s["session_id"] for s in listing]
    assert store.client.xlen(pending["stream"]) == 0, "applied entries are deleted"


def test_sessions_spread_over_the_shards_and_are_listed_from_all(
    worker: Worker, store: Store, cli: dict[str, str], cluster: RedisCluster
) -> None:
    ids = []
    for i in range(6):
        run = agents(
            "session", "start", "--agent-file", DEMO_AGENT, "-p", f"What is the weather in Oslo? ({i})",
            "--run", "--json", env=cli,
        )  # fmt: skip
        assert run.returncode == 0 and run.doc["state"] == "completed", run
        ids.append(run.doc["session_id"])
    shards = {store.keys.shard_of(sid) for sid in ids}
    primaries = {cluster.owner(tag_slot(sid)) for sid in ids}
    assert len(shards) > 1, "new sessions go to several shards"
    listed = [s["session_id"] for s in agents("session", "list", "--json", "--limit", "100", env=cli).doc["sessions"]]
    assert set(ids) <= set(listed)
    assert agents("session", "show", ids[0][:10], "--json", env=cli).doc["session_id"] == ids[0], "id prefixes"
    for sid in ids:
        check_invariants(store, sid)
    # The fleet's counters are read from every shard, what their short lists hold included.
    counted = store.counters()
    assert counted[("steps", "committed")] == sum(store.header(s).steps for s in listed), counted
    doctor = agents("doctor", "--json", env=cli).doc
    checks = {c["name"]: c for c in doctor["checks"]}
    assert checks["completions"]["severity"] == "ok", checks["completions"]
    print(f"6 sessions on {len(shards)} shards, {len(primaries)} primaries")


def test_the_completions_protocol_on_every_shard(
    worker: Worker, store: Store, cli: dict[str, str], cluster: RedisCluster
) -> None:
    """Decisions, results and refusals go through the shard streams: a bad token is rejected (and
    kept where doctor shows it), a second completion of one token is refused, a decision applies."""
    a = agents("session", "start", "--agent-file", DEMO_AGENT, "-p", PROMPT, "--run", "--json", env=cli).doc
    [pa] = a["pending"]
    # an entry naming no known token, on another shard's stream: rejected, not lost
    other = next(k for k in store.keys.all_shards() if k.completions != pa["stream"])
    store.client.xadd(other.completions, {"token": "nope.nopenopenopenopenopenope", "result": "1"})
    store.client.xadd(pa["stream"], {"token": pa["token"], "error": "the restaurant is closed"})
    store.client.xadd(pa["stream"], {"token": pa["token"], "result": json.dumps("too late")})
    poll(lambda: agents("session", "show", a["session_id"], "--json", env=cli).doc["state"] == "completed", "done")
    reasons = poll(
        lambda: (r := sorted(e["reason"] for e in store.recent_rejections(10))) and len(r) >= 2 and r,
        "both refusals recorded",
    )
    assert reasons == ["token_already_completed", "unknown_token"], reasons
    assert store.completions_waiting() == 0
    turns = agents("session", "show", a["session_id"], "--json", env=cli).doc
    assert "closed" in json.dumps(turns)


def test_a_worker_on_a_cluster_without_a_broker_refuses_to_start(cluster: RedisCluster, tmp_path: Path) -> None:
    env = worker_env(cluster.url(), "nobroker", tmp_path / "home")
    run = agents("worker", env=env, timeout=60)
    assert run.returncode == 2, run
    assert "AGENTS_BROKER_URL" in run.stderr + run.stdout


def test_scripts_missing_on_every_primary_are_loaded_again_in_pipelines_and_alone(
    store: Store, cluster: RedisCluster
) -> None:
    """A promoted replica has none of the scripts (Redis does not replicate them): a store sends
    each again where a node answers NOSCRIPT, inside a pipeline (the sweeper's) as alone."""
    from celery_agents.model import UserQuery
    from tests.store.scenario import AGENT

    sids = [store.create_session(AGENT, UserQuery(text="hi"), drive="auto", owe=True).session_id for _ in range(6)]
    for node in store.client.get_primaries():  # type: ignore[attr-defined]
        node.redis_connection.script_flush()
    swept = store.sweep_owed([(sid, False) for sid in sids], store.server_time())
    assert [s.session_id for s in swept] == sids and all(s.verdict.value == "waiting" for s in swept)
    for node in store.client.get_primaries():  # type: ignore[attr-defined]
        node.redis_connection.script_flush()
    store.cancel(sids[0])
    assert store.header(sids[0]).status.value == "cancelled"


def test_the_keys_of_scripts_and_stream_reads_are_read_from_the_command() -> None:
    """redis-py would ask the default node (COMMAND GETKEYS); a dead default node must not stop them."""
    from celery_agents.store.connection import _local_keys

    assert _local_keys(("EVALSHA", "sha", 2, "a", "b", "x")) == ["a", "b"]
    assert _local_keys(("XREADGROUP", "GROUP", "g", "c", "COUNT", 5, "STREAMS", "s1", ">")) == ["s1"]
    assert _local_keys(("GET", "a")) is None


def test_interrupts_published_from_every_primary_are_heard(store: Store) -> None:
    """`session send --interrupt` publishes from inside the session's script, on its primary: the
    Cluster carries the message to a listener subscribed through any node."""
    import threading

    from celery_agents.model import UserQuery
    from tests.store.scenario import start

    sids = [start(store, drive="auto") for _ in range(6)]
    assert len({store.keys.shard_of(s) for s in sids}) > 1
    heard = threading.Event()
    watches = [store.watch_interrupts(s) for s in sids]
    for w in watches:
        w.on_notice(lambda version, queued: heard.set() if all(x.notices for x in watches) else None)
    for sid in sids:
        store.send_message(sid, UserQuery(text="stop"), interrupt=True)
    assert heard.wait(10), [w.notices for w in watches]
    assert all(w.notices == [(1, 1)] for w in watches)
