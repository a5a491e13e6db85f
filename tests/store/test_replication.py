"""Writes that wait for replicas (store/replication.py) on the real Redis, which has none here: a
write no replica acknowledged stands and writes rest, unless the server that took it is no longer
the master, when it is sent again (at most three times), answering with its first reply."""

from __future__ import annotations

from typing import Any

import pytest

from celery_agents.errors import RedisUnavailable
from celery_agents.store import Store
from celery_agents.store.replication import ReplicaAcks
from tests.store.scenario import start


def test_a_write_no_replica_acknowledged_stands_and_writes_rest(store: Store) -> None:
    asked: list[Any] = []
    store.acks = store.scripts.acks = ReplicaAcks(1, timeout_ms=10, replaced=lambda a: asked.append(a) or False)
    sid = start(store)
    assert store.acks.short == 1 and store.acks.moved == 0
    assert len(asked) == 1 and asked[0][1] is not None, "asked about the server that took the write"
    assert not store.acks.waiting, "writes rest after a write no replica acknowledged"
    assert store.header(sid).version == 1


def test_a_write_on_a_replaced_master_goes_again_and_gives_up_after_three(store: Store) -> None:
    sid = start(store)
    store.acks = store.scripts.acks = ReplicaAcks(1, timeout_ms=10, replaced=lambda a: True)
    with pytest.raises(RedisUnavailable, match="no longer the master"):
        store.cancel(sid)  # sent three times: each time the "old master" took it
    assert store.acks.moved == 3 and store.acks.short == 0
    assert store.acks.waiting, "a replaced master is no reason to stop waiting"
    assert store.header(sid).status == "cancelled", "the repeats answered with the first reply"
