"""Session state on Redis Sentinel (one primary, two replicas, three sentinels with quorum 2): the
primary is SIGKILLed and a store follows the promoted replica without a restart, loading its
scripts there (a replica has none: Redis does not replicate its script cache). What a replica
acknowledged survives the failover; what none acknowledged may be lost, and a worker that had read
it finds the session rewound (`agents doctor`)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.store import Store, client_for_url
from tests.chaos.conftest import report
from tests.chaos.invariants import check_invariants
from tests.scheduler.fakes import ScriptedLlm, llm_turn
from tests.store.scenario import begin, start, step
from tests.support.redis_server import RedisServer
from tests.support.sentinel import MASTER, SentinelSet

pytestmark = pytest.mark.slow


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelSet]:
    s = SentinelSet(tmp_path / "sentinel").start()
    yield s
    s.stop()


def worker_store(sentinels: SentinelSet, prefix: str, **settings: object) -> Store:
    """A store as a worker makes it: it waits out an unreachable Redis for up to 30 s."""
    url = sentinels.url()
    return Store(client_for_url(url), Settings(redis_url=url, prefix=prefix, **settings), outage_seconds=30)  # type: ignore[arg-type]


def doctor_check(sentinels: SentinelSet, prefix: str, home: Path, name: str) -> dict[str, object]:
    settings = Settings(redis_url=sentinels.url(), prefix=prefix, home=home)
    with Client(settings, inline=True) as client:
        (found,) = [c for c in client.doctor()["checks"] if c["name"] == name]
    return found


def lose_the_next_step(sentinels: SentinelSet, store: Store, sid: str) -> RedisServer:
    """Step `sid` once (the model asks for a tool), then commit the tools step with both replicas
    frozen and cut off, so that it stands on the primary alone, and SIGKILL the primary: the
    step is lost with it. Returns the killed primary; the replicas run again."""
    step(store, sid, ScriptedLlm(llm_turn(("c1", "sync_a", "{}"))))
    replicas = [s for s in sentinels.servers if s.port != sentinels.master_port()]
    for r in replicas:
        assert r.proc is not None
        r.proc.send_signal(signal.SIGSTOP)
    primary = sentinels.admin(sentinels.master_port() or 0)
    try:
        # Cut off too, or they would read the commit from their sockets once they run again.
        primary.client_kill_filter(_type="replica")
        step(store, sid)  # the tools step: committed on the primary only
        assert store.acks.short == 1, "the commit said no replica had it"
        return sentinels.kill_master()
    finally:
        for r in replicas:
            assert r.proc is not None
            r.proc.send_signal(signal.SIGCONT)


def test_a_store_follows_the_master_through_a_failover_and_loads_its_scripts_there(
    sentinels: SentinelSet, prefix: str, tmp_path: Path
) -> None:
    replicas_check = doctor_check(sentinels, prefix, tmp_path, "replicas")
    assert replicas_check["severity"] == "ok", replicas_check
    assert str(replicas_check["detail"]).startswith("2 replica(s) online; writes wait for 1")
    store = worker_store(sentinels, prefix)
    sid = start(store)
    step(store, sid, ScriptedLlm(llm_turn(("c1", "sync_a", "{}"))))
    sha = store.scripts.sha("begin_step")
    replicas = [s for s in sentinels.servers if s.port != sentinels.master_port()]
    for r in replicas:  # Redis 7 replicates no script; 6.2 replicates what SCRIPT LOAD loads
        sentinels.admin(r.port).script_flush()

    old = sentinels.kill_master()
    killed = time.monotonic()
    done = step(store, sid)  # the tools step: begun and committed on whichever server is the master now
    recovered = time.monotonic() - killed
    new = sentinels.master_port()
    assert new is not None and new != old.port
    assert sentinels.admin(new).script_exists(sha) == [True]
    assert done.result is not None and done.result.version == 3
    assert store.header(sid).version == 3, "the step before the kill is there, and the one after"
    check_invariants(store, sid, completed=False)
    report("sentinel failover, one store", first_step_after_kill_s=round(recovered, 2))


def test_every_session_a_replica_acknowledged_is_on_the_promoted_replica(sentinels: SentinelSet, prefix: str) -> None:
    """Four threads start sessions as fast as they can while the primary is killed: every session
    whose start returned is there after the failover."""
    store = worker_store(sentinels, prefix)
    assert store.acks.replicas == 1, "on Sentinel, writes wait for one replica by default"
    started: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def starter() -> None:
        try:
            while not stop.is_set():
                started.append(start(store))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=starter, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    while len(started) < 200 and not errors:
        time.sleep(0.01)
    before = len(started)
    old = sentinels.kill_master()
    sentinels.wait_failover(old.port)
    count = len(started)
    while len(started) < count + 200 and not errors:  # and they go on, on the new master
        time.sleep(0.01)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[0]
    pipe = store.client.pipeline(transaction=False)
    for sid in started:
        pipe.exists(store.keys.meta(sid))
    missing = [sid for sid, there in zip(started, pipe.execute(), strict=True) if not there]
    assert not missing, f"{len(missing)} of {len(started)} acknowledged sessions were lost"
    assert store.acks.short == 0
    report("sentinel failover, starts", acknowledged=len(started), before_kill=before, lost=len(missing))


def test_a_write_no_replica_acknowledged_may_be_lost_and_is_found_rewound(
    sentinels: SentinelSet, prefix: str, tmp_path: Path
) -> None:
    """With both replicas frozen and cut off, a commit waits 1 s for them, stands on the primary
    alone, and dies with it: the session is back where the replicas last saw it. The worker that had read
    the lost step finds the session rewound, reads the stored transcript, and doctor fails until
    an operator acknowledges it."""
    store = worker_store(sentinels, prefix)
    sid = start(store)
    old = lose_the_next_step(sentinels, store, sid)
    sentinels.wait_failover(old.port)
    assert store.header(sid).version == 2, "the promoted replica never had the tools step"
    begin(store, sid, "w2")  # the worker that cached version 3 reads the session again
    assert store.rewound_sessions().unacknowledged == 1
    check = doctor_check(sentinels, prefix, tmp_path, "rewound sessions")
    assert check["severity"] == "error" and sid in str(check["detail"])


def test_a_lost_write_is_found_by_its_writer_without_reading_its_session_again(
    sentinels: SentinelSet, prefix: str
) -> None:
    """A worker's commit stands on the primary alone (replicas frozen and cut off) and dies with
    it. That worker never steps the session again (another one does): it finds the loss itself,
    at its next write acknowledged on the promoted replica, and the session is recorded rewound
    before anyone reads it, so doctor names it."""
    store = worker_store(sentinels, prefix)
    store.acks.rest_s = 0.5  # writes wait again soon after one fell short
    sid = start(store)
    old = lose_the_next_step(sentinels, store, sid)
    new = sentinels.wait_failover(old.port)
    sentinels._wait(
        lambda: any(
            sentinels.admin(s.port).info("replication").get("master_port") == new
            for s in sentinels.servers
            if s.port not in (old.port, new)
        ),
        "a replica to follow the promoted one",
    )
    assert sentinels.admin(new).hget(store.keys.meta(sid), "version") == "2", "the tools step was lost"
    sentinels._wait(lambda: store.acks.waiting, "writes to wait for replicas again")
    start(store)  # the worker's next write, on another session, acknowledged by a replica
    rewound = store.rewound_sessions()
    assert rewound.unacknowledged == 1 and sid in rewound.sessions, rewound


def test_a_write_to_a_master_the_sentinels_replaced_goes_to_the_promoted_one(
    sentinels: SentinelSet, prefix: str
) -> None:
    """The primary freezes (SIGSTOP) long enough for the sentinels to promote a replica, then runs
    again: until the sentinels turn it into a replica (seconds later), it still takes writes on
    the connections a store keeps, and none of its replicas is left to acknowledge them. A step
    begun and committed there would be lost with it; the store sees that no replica acknowledged
    the write, asks the sentinels, and sends the write again to the master they name."""
    store = worker_store(sentinels, prefix)
    runner = worker_store(sentinels, prefix)  # another process: a dispatched call's runner
    sid = start(store)
    step(store, sid, ScriptedLlm(llm_turn(("c1", "sync_a", "{}"))))
    assert runner.header(sid).version == 2  # its pool keeps a connection to the primary too
    old_port = sentinels.master_port()
    assert old_port is not None
    old = sentinels.server_on(old_port)
    assert old.proc is not None
    old.proc.send_signal(signal.SIGSTOP)
    try:
        new = sentinels.wait_failover(old_port)
        others = [s.port for s in sentinels.servers if s.port not in (old_port, new)]
        # The other replica follows the promoted one (else it could acknowledge the stale master's writes).
        sentinels._wait(
            lambda: all(sentinels.admin(p).info("replication").get("master_port") == new for p in others),
            "the other replica to follow the promoted one",
        )
    finally:
        old.proc.send_signal(signal.SIGCONT)
    assert sentinels.admin(old_port).info("replication")["role"] == "master", "the frozen one still acts as master"
    done = step(store, sid)  # the tools step, on the store's kept connections to the old primary
    assert done.result is not None and done.result.version == 3
    on_new = sentinels.admin(new).hget(store.keys.meta(sid), "version")
    assert on_new == "3", "the step is on the master the sentinels name, not only on the replaced one"
    assert store.acks.moved >= 1
    # The marker a worker writes before it runs a dispatched call goes the same way.
    runner.mark_call_started(sid, "c9", "runner")
    assert sentinels.admin(new).get(runner.keys.call_started(sid, "c9")) == "runner"
    assert runner.acks.moved == 1


def test_a_write_while_the_sentinels_replace_its_master_waits_and_goes_to_the_promoted_one(
    tmp_path: Path, prefix: str
) -> None:
    """The primary stops answering the sentinels (it now asks for a password they do not have) yet
    serves the connections a store keeps; its replicas, cut off, cannot come back, and none may
    be promoted yet (replica priority 0). While the sentinels see it down and try to replace it,
    a step's writes fall short of a replica: the step waits, sending them again, until the
    sentinels promote the replica they are then allowed to, and lands there. Before, the first
    write stood on the old primary and writes stopped waiting: the step never reached the new one."""
    sentinels = SentinelSet(tmp_path / "sentinel", replica_priority=0, failover_timeout_ms=2000).start()
    try:
        store = worker_store(sentinels, prefix)
        sid = start(store)
        step(store, sid, ScriptedLlm(llm_turn(("c1", "sync_a", "{}"))))
        old_port = sentinels.master_port()
        assert old_port is not None
        primary = sentinels.admin(old_port)
        primary.config_set("requirepass", "not-the-sentinels")
        for c in primary.client_list():  # the replicas and the sentinels must log in again: they cannot
            if c["name"].startswith("sentinel-") or "S" in c["flags"]:
                primary.client_kill_filter(_id=c["id"])

        def seen_down() -> bool:
            return any(sentinels.sentinel(p).sentinel_master(MASTER)["is_odown"] for p in sentinels.sentinel_ports)

        sentinels._wait(seen_down, "the sentinels to agree the primary is down")
        promoted: list[int] = []
        stepped = threading.Event()

        def allow_a_promotion() -> None:  # once the step waits on the failover (or is done)
            while store.acks.moved == 0 and not stepped.is_set():
                time.sleep(0.05)
            replica = next(s.port for s in sentinels.servers if s.port != old_port)
            sentinels.admin(replica).config_set("replica-priority", "100")
            promoted.append(replica)

        helper = threading.Thread(target=allow_a_promotion, daemon=True)
        helper.start()
        done = step(store, sid)  # the tools step, begun on the old primary's kept connection
        waited = store.acks.moved
        stepped.set()
        helper.join(timeout=5)
        assert done.result is not None and done.result.version == 3
        new = sentinels.wait_failover(old_port)
        assert new == promoted[0]
        on_new = sentinels.admin(new).hget(store.keys.meta(sid), "version")
        assert on_new == "3", "the step is on the promoted replica, not only on the replaced primary"
        assert waited > 0, "the step waited on the failover"
    finally:
        sentinels.stop()


def count_questions(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list whose length is the number of `SENTINEL MASTERS` the store sends from now on (a
    sentinel's INFO has no command statistics)."""
    asked: list[int] = []
    for sentinel in store.client.connection_pool.sentinel_manager.sentinels:  # type: ignore[attr-defined]

        def masters(ask: Any = sentinel.sentinel_masters) -> Any:
            asked.append(1)
            return ask()

        monkeypatch.setattr(sentinel, "sentinel_masters", masters)
    return asked


def test_writes_short_of_their_replicas_at_once_ask_the_sentinels_once(
    sentinels: SentinelSet, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forty threads whose writes no replica acknowledged ask what the sentinels say of the
    primary at the same moment (as a steps process's threads do in a failover, each again at
    every send): the sentinels are asked once, and every thread gets their answer. An answer
    older than `VERDICT_SECONDS` is not taken: the next write asks again."""
    from celery_agents.store import connection
    from celery_agents.store.replication import MASTER

    store = worker_store(sentinels, prefix)
    verdict = store.acks.sentinels
    assert verdict is not None
    primary = ("127.0.0.1", sentinels.master_port())
    asked = count_questions(store, monkeypatch)
    gate = threading.Barrier(40)
    answers: list[str] = []

    def write_fell_short() -> None:
        gate.wait()
        answers.append(verdict(primary))

    threads = [threading.Thread(target=write_fell_short) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [MASTER] * 40
    assert len(asked) == len(sentinels.sentinel_ports), "one round of questions"
    monkeypatch.setattr(connection, "VERDICT_SECONDS", 0.0)
    assert verdict(primary) == MASTER
    assert len(asked) == 2 * len(sentinels.sentinel_ports), "asked again"
