"""The sweeper reads every index shard in one round trip and settles what is due in another: a
shard out of reach for a moment (on a Cluster, its slot moving between primaries, its primary
failing over) must not hold up the others. Here four shards live on the real Redis and the
replies of one shard's keys are those of a moving slot (`TRYAGAIN`), as redis-py hands them over."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import redis

from celery_agents.errors import RedisUnavailable
from celery_agents.store import Store
from celery_agents.store.connection import StatePipeline, StateRedis, translated
from tests.store.scenario import start


class MovingPipeline(StatePipeline):
    """Answers every command naming a key under `moving` with TRYAGAIN, as a Cluster does while
    that key's slot moves; raises it as redis-py does unless told to hand errors back."""

    moving = ""

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        named = [
            bool(self.moving) and any(isinstance(a, str) and a.startswith(self.moving) for a in args)
            for args, _ in self.command_stack
        ]
        replies = super().execute(raise_on_error=False)
        replies = [redis.exceptions.TryAgainError("TRYAGAIN") if n else r for n, r in zip(named, replies, strict=True)]
        failed = [r for r in replies if isinstance(r, Exception)]
        if failed and raise_on_error:
            raise translated(failed[0])
        return replies


class OneShardMoving(StateRedis):
    moving = ""

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = MovingPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.moving = self.moving
        return pipe


@pytest.fixture
def sharded(store: Store) -> Store:
    client = OneShardMoving(connection_pool=store.client.connection_pool)
    return Store(client, replace(store.settings, index_shards=4))


def test_the_sweeper_reads_and_settles_the_shards_in_reach(sharded: Store) -> None:
    sids = [start(sharded, owe=True, drive="auto") for _ in range(16)]
    by_shard = {sharded.keys.shard_of(s) for s in sids}
    assert len(by_shard) > 1, "the sessions are on several shards"
    moving = sharded.keys.shard_of(sids[0])
    later = sharded.server_time() + 60
    assert {s for s, _ in sharded.owed_due(later)} == set(sids)

    client: Any = sharded.client
    client.moving = sharded.keys.all_shards()[moving].owed.rsplit(":", 1)[0]  # that shard's keys
    elsewhere = {s for s in sids if sharded.keys.shard_of(s) != moving}
    assert {s for s, _ in sharded.owed_due(later)} == elsewhere, "the other shards are read"
    assert sharded.anything_due(later)
    client.moving = f"{sharded.settings.prefix}:s:{{{sids[0]}}}"  # that session's own keys
    swept = sharded.sweep_owed([(s, False) for s in sids], later)
    assert {s.session_id for s in swept} == set(sids) - {sids[0]}, "the others are settled"


def test_every_shard_out_of_reach_is_an_outage_as_before(sharded: Store) -> None:
    start(sharded, owe=True, drive="auto")
    client: Any = sharded.client
    client.moving = f"{sharded.settings.prefix}:"
    with pytest.raises(RedisUnavailable):
        sharded.owed_due(sharded.server_time() + 60)
