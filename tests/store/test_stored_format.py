"""The stored format: a Redis remembers the layout of what celery-agents keeps in it
(`<prefix>:format`); a worker or a new session refuses a Redis holding another layout, naming
the fix, instead of misreading it."""

from __future__ import annotations

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.errors import IncompatibleData
from celery_agents.store import Store
from celery_agents.store.core import STORED_FORMAT
from tests.scheduler.fakes import make_agent


def test_the_first_check_records_the_format_and_later_ones_pass(store: Store) -> None:
    key = store.keys.format
    assert store.client.get(key) is None
    store.check_format()
    assert store.client.get(key) == str(STORED_FORMAT)
    store.check_format()


def test_a_redis_holding_another_format_is_refused_by_workers_and_new_sessions(settings: Settings) -> None:
    with Client(settings, inline=True) as client:
        client.store.client.set(client.store.keys.format, str(STORED_FORMAT + 1))
        with pytest.raises(IncompatibleData) as caught:
            client.store.check_format()
        assert f"format {STORED_FORMAT + 1}" in caught.value.message and "AGENTS_PREFIX" in caught.value.message
        with pytest.raises(IncompatibleData):
            client.start(make_agent(), "hi")
        assert client.list() == [], "no session was written"


def test_the_index_of_all_sessions_an_earlier_release_kept_is_dropped_and_its_sessions_still_listed(
    settings: Settings,
) -> None:
    with Client(settings, inline=True) as client:
        sid = client.start(make_agent(), "hi").session_id
        r, keys = client.store.client, client.store.keys
        r.zadd(keys.old_sessions_index, {sid: 1, "a-session-long-gone": 2})  # as an earlier release left it
        client.store.check_format()
        assert r.exists(keys.old_sessions_index) == 0
        assert [v.session_id for v in client.list()] == [sid]


def test_a_redis_of_the_format_before_is_refused(settings: Settings) -> None:
    """Format 3 differs only in that a waiting session's events stay a stream, but a process of
    that release, running on, would write a stream beside the packed events and lose them: the
    data is drained with the release that wrote it, not marked as this one's."""
    with Client(settings, inline=True) as client:
        client.store.client.set(client.store.keys.format, "3")
        with pytest.raises(IncompatibleData):
            client.store.check_format()
        assert client.store.client.get(client.store.keys.format) == "3"
