"""Writes that wait for replicas (store/replication.py) on the real Redis, which has none here: a
write no replica acknowledged stands and writes rest, unless the sentinels name another master
(the write goes again, at most three times, answering with its first reply) or see a failover
under way (again every pause, until the time given to a failover has passed: then it stands).
The sessions written while no replica acknowledged are checked at the next acknowledged write: one
stored lower than this process wrote it is recorded rewound."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from celery_agents.errors import RedisUnavailable
from celery_agents.store import Store, replication
from celery_agents.store.connection import translated
from celery_agents.store.replication import MASTER, REPLACED, SETTLE_S, UNSETTLED, ReplicaAcks
from tests.scheduler.fakes import ScriptedLlm, llm_turn
from tests.store.scenario import start, step


def acks_saying(store: Store, verdict: str, asked: list[Any]) -> ReplicaAcks:
    acks = ReplicaAcks(1, timeout_ms=10, sentinels=lambda address: asked.append(address) or verdict)
    store.acks = store.scripts.acks = acks
    return acks


def test_a_write_no_replica_acknowledged_stands_and_writes_rest(store: Store) -> None:
    asked: list[Any] = []
    acks = acks_saying(store, MASTER, asked)
    sid = start(store)
    assert acks.short == 1 and acks.moved == 0
    assert len(asked) == 1 and asked[0][1] is not None, "asked about the server that took the write"
    assert not acks.waiting, "writes rest after a write no replica acknowledged"
    assert store.header(sid).version == 1


def test_a_write_on_a_replaced_master_goes_again_and_gives_up_after_three(store: Store) -> None:
    sid = start(store)
    asked: list[Any] = []
    acks = acks_saying(store, REPLACED, asked)
    with pytest.raises(RedisUnavailable, match="is no longer the master"):
        store.cancel(sid)  # sent three times: each time the "old master" took it
    assert acks.moved == 3 and acks.short == 0 and len(asked) == 3
    assert acks.waiting, "a replaced master is no reason to stop waiting"
    assert store.header(sid).status == "cancelled", "the repeats answered with the first reply"


def test_a_write_during_a_failover_goes_again_until_the_failover_had_its_time(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replication, "SETTLE_FOR_S", 2.5 * SETTLE_S)
    sid = start(store)
    asked: list[Any] = []
    acks = acks_saying(store, UNSETTLED, asked)
    began = time.monotonic()
    assert store.cancel(sid) >= 0
    assert time.monotonic() - began >= 2.5 * SETTLE_S, "sent again until the failover had its time"
    assert acks.moved >= 2 and acks.short == 1 and len(asked) == acks.moved + 1
    assert not acks.waiting, "then it stood: writes rest"
    assert store.header(sid).status == "cancelled"


def test_sessions_written_unacknowledged_are_handed_back_by_the_next_acknowledged_write() -> None:
    acks = ReplicaAcks(1, rest_s=0.0)
    first = acks.begin()
    acks.answered(0)  # short: stands
    assert acks.settle("s1", first) == []
    second = acks.begin()
    acks.unwaited()  # made while writes rest
    assert acks.settle("s2", second) == []
    third = acks.begin()
    late = acks.begin()  # begun before the acknowledged one, finished after it
    acks.answered(1)
    assert acks.settle("s3", third) == ["s1", "s2"]
    acks.answered(0)
    assert acks.settle("s4", late) == []
    fourth = acks.begin()
    acks.answered(1)
    assert acks.settle("s5", fourth) == ["s4"]
    assert acks.settle("s6", acks.begin()) == [], "a write that waited on nothing (no WAIT) settles nothing"


def test_a_session_found_lower_than_this_process_wrote_it_is_recorded_rewound(store: Store) -> None:
    sid = start(store)
    step(store, sid, ScriptedLlm(llm_turn(("c1", "sync_a", "{}"))))
    other = start(store)
    step(store, other, ScriptedLlm(llm_turn(text="done")))
    assert store.header(sid).version == 2
    store.client.hset(store.keys.meta(sid), "version", 1)  # what a failover that lost the step leaves
    store._check_unconfirmed([sid, other])
    rewound = store.rewound_sessions()
    assert list(rewound.sessions) == [sid]
    assert rewound.sessions[sid]["seen_version"] == 2 and rewound.sessions[sid]["stored_version"] == 1
    assert sid not in store._turn_cache, "its cached turns are dropped: the next step reads the stored ones"


def test_a_check_that_cannot_read_says_so_and_leaves_the_write_alone(
    store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    sid = start(store)
    step(store, sid, ScriptedLlm(llm_turn(("c1", "sync_a", "{}"))))

    class Refusing:
        def hgetall(self, key: str) -> None: ...

        def execute(self) -> list[Any]:
            raise translated(redis.ResponseError("LOADING Redis is loading the dataset in memory"))

    monkeypatch.setattr(store.client, "pipeline", lambda transaction=True: Refusing())
    store._check_unconfirmed([sid])  # the write that asked went through: nothing is raised to it
    assert "could not check 1 session(s)" in caplog.text
