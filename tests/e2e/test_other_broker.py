"""`AGENTS_BROKER_URL` naming another broker (RabbitMQ here, in a virtual host of its own): steps,
tool calls and a Redis-only completion go through it, doctor reads its queues, and the sweeper
republishes a step whose message never left (the broker's queue was empty) without flooding the
queue while that message waits."""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from celery_agents.config import Settings
from celery_agents.model import UserQuery
from celery_agents.store import Store, client_for_url
from celery_agents.tools.resolve import parse_agent
from tests.cli.process import DEMO_AGENT, agents, cli_env, poll
from tests.support.workers import Worker, worker_env

AMQP = "amqp://guest:guest@127.0.0.1:5672"


def _rabbitmqctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["rabbitmqctl", *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def broker_url() -> Iterator[str]:
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("needs a local RabbitMQ (rabbitmqctl)")
    vhost = f"celery-agents-test-{uuid.uuid4().hex[:8]}"
    if _rabbitmqctl("add_vhost", vhost).returncode != 0:
        pytest.skip("cannot add a RabbitMQ virtual host here")
    try:
        _rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        yield f"{AMQP}/{vhost}"
    finally:
        _rabbitmqctl("delete_vhost", vhost)


def depth(broker: str, queue: str) -> int:
    """Messages waiting in a queue of the broker (0 while nobody has declared it)."""
    from kombu import Connection
    from kombu.exceptions import ChannelError

    with Connection(broker) as conn:
        try:
            _, n, _ = conn.default_channel.queue_declare(queue=queue, passive=True)
        except ChannelError:
            return 0
        return int(n)


def test_sessions_run_through_another_broker(broker_url: str, redis_url: str, tmp_path: Path) -> None:
    prefix = f"br{uuid.uuid4().hex[:8]}"
    env = worker_env(redis_url, prefix, tmp_path / "home", AGENTS_BROKER_URL=broker_url)
    worker = Worker(env, log=tmp_path / "worker.log", name=f"amqp-{prefix}@test").start()
    try:
        state = redis.Redis.from_url(redis_url, decode_responses=True)
        worker.wait_ready(state, prefix)
        cli = cli_env(redis_url, prefix, tmp_path / "home", AGENTS_BROKER_URL=broker_url)
        started = agents(
            "session", "start", "--agent-file", DEMO_AGENT, "-p",
            "What is the weather in Paris? Please book a table in Paris.", "--run", "--json", env=cli,
        )  # fmt: skip
        assert started.returncode == 0 and started.doc["state"] == "waiting", started
        [pending] = started.doc["pending"]
        state.xadd(f"{prefix}:completions", {"token": pending["token"], "result": json.dumps("booked")})
        sid = started.doc["session_id"]
        done = poll(
            lambda: (v := agents("session", "show", sid, "--json", env=cli).doc)["state"] == "completed" and v,
            "the session to complete",
        )
        assert "booked" in done["response"] and "Right now in Paris" in done["response"]
        doctor = agents("doctor", "--json", env=cli).doc
        assert doctor["queues"] == {"steps": 0, "tools": 0, "isolated": 0}, doctor
        assert not any(key.startswith(f"{prefix}:celery:") for key in state.scan_iter(f"{prefix}:*")), (
            "no broker keys in the state Redis"
        )
    finally:
        worker.stop()


def test_the_sweeper_reads_the_brokers_queue(broker_url: str, redis_url: str, tmp_path: Path) -> None:
    prefix = f"bs{uuid.uuid4().hex[:8]}"
    # This worker takes no steps: a step's message stays in the broker's queue.
    env = worker_env(redis_url, prefix, tmp_path / "home", AGENTS_BROKER_URL=broker_url, AGENTS_OWED_GRACE="1")
    worker = Worker(env, queues="tools", log=tmp_path / "worker.log", name=f"sweep-{prefix}@test").start()
    settings = Settings(redis_url=redis_url, prefix=prefix, home=tmp_path / "home")
    store = Store(client_for_url(redis_url), settings)
    try:
        worker.wait_ready(store.client, prefix)
        lock = store.keys.lock("sweeper")

        def sweeps(n: int) -> None:
            """Wait until the sweeper has run `n` more times (each run takes its short lock)."""
            seen, last = 0, -1
            while seen < n:
                ttl = poll(lambda: (t := store.client.pttl(lock)) > 0 and t, "a sweep")
                if ttl > last:
                    seen += 1
                last = ttl

        # Owed, but its message never left (a publisher died between commit and publish).
        agent = parse_agent({"slug": "sweep", "model": "demo/sweep"})
        sid = store.create_session(agent, UserQuery(text="Hello"), drive="auto", owe=True).session_id
        poll(lambda: depth(broker_url, "steps") == 1, "the sweeper to publish the lost step (the queue was empty)")
        sweeps(8)  # more than a second: past the grace again, while that message waits in the queue
        assert depth(broker_url, "steps") == 1, "a message waiting in the broker's queue is not duplicated"
        doctor = agents("doctor", "--json", env=cli_env(redis_url, prefix, AGENTS_BROKER_URL=broker_url)).doc
        assert doctor["queues"]["steps"] == 1
        assert store.header(sid).state.value == "ready"
    finally:
        worker.stop()
        store.client.close()


def test_higher_priority_steps_are_taken_first_from_a_rabbitmq_queue(
    broker_url: str, redis_url: str, tmp_path: Path
) -> None:
    """The `steps` queue is a priority queue there (x-max-priority): steps published while no
    worker takes them are taken highest priority first once one does."""
    prefix = f"bp{uuid.uuid4().hex[:8]}"
    settings = Settings(redis_url=redis_url, prefix=prefix, home=tmp_path / "home", broker_url=broker_url)
    from celery_agents import Client

    agent = parse_agent({"slug": "prio", "model": "demo/prio"})
    with Client(settings, inline=False) as client:
        before = depth(broker_url, "steps")  # another test of the module may leave one waiting
        lows = [client.start(agent, f"low {i}", run=True, wait=False, priority=0).session_id for i in range(20)]
        highs = [client.start(agent, f"high {i}", run=True, wait=False, priority=9).session_id for i in range(3)]
        assert depth(broker_url, "steps") == before + 23
        env = worker_env(redis_url, prefix, tmp_path / "home", AGENTS_BROKER_URL=broker_url)
        worker = Worker(env, log=tmp_path / "worker.log", name=f"prio-{prefix}@test", step_threads=1).start()
        try:
            poll(lambda: all(client.view(s).state.value == "completed" for s in [*lows, *highs]), "every session")
        finally:
            worker.stop()
        ended = {s: client.view(s).updated_at for s in [*lows, *highs]}
    first = sorted(ended, key=ended.__getitem__)[:3]
    assert sorted(first) == sorted(highs), "the three high-priority sessions ended first"
