"""What a paused session costs in Redis (bench key `paused_session_bytes`): the session waiting on
a deferred call, as bench/paused_memory.py measures it. Its header, its versions and its pending
calls stay compact hashes (listpacks), nothing is stored twice or at its default, and its events
stream is rewritten at its size when it starts to wait, instead of keeping the 4 KB Redis gives a
new stream node; the stream goes on as before afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.harness import DEFER_AGENT
from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.store.header import SPARSE
from celery_agents.tools.resolve import parse_agent
from tests.support.redis_server import RedisServer

REDIS_7 = "/usr/bin/redis-server"
AGENT = DEFER_AGENT  # the benchmark's paused session: a booking waiting on a person


@pytest.fixture
def paused(settings: Settings) -> Iterator[tuple[Client, str]]:
    with Client(settings, inline=True) as client:
        sid = client.start(parse_agent(AGENT), "Please book a table in Paris.").session_id
        client.step(sid)
        view = client.step(sid)
        assert view.state.value == "waiting" and [p.tool for p in view.pending] == ["book_table"]
        yield client, sid


def encoding(client: Client, key: str) -> str:
    return str(client.store.client.object("encoding", key))


def test_a_paused_sessions_header_versions_and_pending_calls_are_compact_hashes(paused: tuple[Client, str]) -> None:
    client, sid = paused
    keys = client.store.keys
    assert encoding(client, keys.meta(sid)) in ("listpack", "ziplist")
    assert encoding(client, keys.versions(sid)) in ("listpack", "ziplist")
    # A set of call fields ("1:0") would be a hashtable: not integers, and Redis 7.0 has no listpack sets.
    assert encoding(client, keys.pending(sid)) in ("listpack", "ziplist")
    assert client.store.client.hkeys(keys.pending(sid)) == ["1:0"]


def test_a_paused_sessions_events_all_have_the_fields_of_the_first(paused: tuple[Client, str]) -> None:
    """Redis stores the field names of a stream's entries once per node when they are those of its
    first entry: every event is `type`, `version`, `data`; its time is its id's."""
    client, sid = paused
    entries = client.store.client.xrange(client.store.keys.events(sid))
    assert len(entries) >= 5 and all(list(fields) == ["type", "version", "data"] for _, fields in entries)
    events = list(client.events(sid))
    assert all(e["at"] == int(e["id"].split("-")[0]) / 1000 for e in events)
    assert [e["type"] for e in events][-2:] == ["token_created", "step_committed"]


def test_a_deferred_calls_token_and_call_hold_nothing_twice(paused: tuple[Client, str]) -> None:
    """The token's hash holds what its scripts read (not the session its key names, nor empty
    fields); the call keeps the model's text of its arguments only when it did not parse (its
    turn holds it)."""
    client, sid = paused
    r, keys = client.store.client, client.store.keys
    (pending,) = client.pending(sid)
    assert pending.token is not None
    held = r.hgetall(keys.token(sid, pending.token.split(".", 1)[1]))
    assert set(held) == {"field", "state", "expires_ms", "call_id", "tool", "digest", "reason"}
    call = json.loads(r.hget(keys.calls(sid), held["field"]))
    assert "raw_arguments" not in call and call["arguments"] == pending.arguments


def test_a_paused_sessions_header_holds_no_field_at_its_default(paused: tuple[Client, str]) -> None:
    client, sid = paused
    stored = client.store.client.hgetall(client.store.keys.meta(sid))
    assert SPARSE & set(stored) == {"usage"}, "of those that may be left out, only what its model call used"
    assert "spent_tool_calls" not in stored, "a spend that is none is not written"
    header = client.store.header(sid)
    assert header.parent is None and header.error is None and header.priority == 5 and header.inbox_waiting == 0


def test_a_paused_sessions_events_take_what_they_hold_not_a_whole_stream_node(paused: tuple[Client, str]) -> None:
    client, sid = paused
    r = client.store.client
    key = client.store.keys.events(sid)
    kept = r.memory_usage(key, samples=0)
    # The same entries written into a fresh stream hold a new node's 4 KB.
    fresh = f"{client.settings.prefix}:fresh-stream"
    for _, fields in r.xrange(key):
        r.xadd(fresh, fields)
    assert r.memory_usage(fresh, samples=0) >= 4096
    assert kept < 2048, f"the paused session's {r.xlen(key)} events take {kept} bytes"


def test_deltas_deleted_earlier_do_not_keep_their_room_in_a_waiting_sessions_stream(
    tmp_path: Path, prefix: str
) -> None:
    """A step whose model streamed to a follower leaves its deltas' room in the stream node when
    its commit deletes them: the stream of a session that starts to wait is written again without
    it, its entries under their ids, and the stream's next ids come after them. (Redis 7 counts
    the entries a stream was given; Redis 6.2 does not, and there only the waiting step's own
    deltas are seen.)"""
    if not Path(REDIS_7).exists():
        pytest.skip(f"no {REDIS_7}")
    server = RedisServer(tmp_path / "r7", binary=REDIS_7).start()
    settings = Settings(redis_url=server.url, prefix=prefix, home=tmp_path / "home")
    with Client(settings, inline=True) as client:
        sid = client.start(parse_agent(AGENT), "Please book a table in Paris.").session_id
        client.step(sid)
        r, key = client.store.client, client.store.keys.events(sid)
        deltas = [r.xadd(key, {"type": "text_delta", "data": '{"text": "' + "x" * 300 + '"}'}) for _ in range(20)]
        r.xdel(key, *deltas)  # as the commit of a streamed step deletes them
        kept = r.xrange(key)
        assert client.step(sid).state.value == "waiting"
        after = r.xrange(key)
        assert after[: len(kept)] == kept and len(after) > len(kept)
        assert r.memory_usage(key, samples=0) < 2048
        last = after[-1][0]
        newer = r.xadd(key, {"type": "probe", "data": "{}"})
        assert tuple(map(int, newer.split("-"))) > tuple(map(int, last.split("-")))
        assert tuple(map(int, newer.split("-"))) > tuple(map(int, deltas[-1].split("-"))), "no id is given twice"
    server.stop(kill=True)


def test_the_events_go_on_after_the_pause(paused: tuple[Client, str]) -> None:
    client, sid = paused
    before = list(client.events(sid))
    (pending,) = client.pending(sid)
    assert pending.token is not None
    client.complete(pending.token, {"booked": True})
    view = client.resume(sid)
    assert view.state.value == "completed"
    after = list(client.events(sid))
    assert after[: len(before)] == before, "the events before the pause are kept as they were"
    ids = [e["id"] for e in after]
    assert len(after) > len(before) and ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))


def test_a_long_summary_is_cut_within_a_compact_hash_value(settings: Settings) -> None:
    with Client(settings, inline=True) as client:
        sid = client.start(parse_agent(AGENT), "é" * 200).session_id
        (first,) = client.store.history(sid)
        assert first.summary.startswith("started: é") and first.summary.endswith("…")
        assert len(first.summary.encode()) <= 64
        assert encoding(client, client.store.keys.versions(sid)) in ("listpack", "ziplist")


@pytest.mark.parametrize("binary", ["/usr/bin/redis-server"])
def test_on_redis_7_a_paused_session_costs_under_5_25_kb(binary: str, tmp_path: object, prefix: str) -> None:
    """The whole of it, as the bench counts it: MEMORY USAGE of its keys, and what its index
    entries add to indexes big enough to be Redis's large encodings. Its keys take the same bytes
    every time (4,312 under this prefix); the index entries vary with the levels Redis draws for
    their skiplist nodes (~720-800). The goal, 4,096, is not met (docs/performance.md)."""
    from bench.paused_memory import paused_session_bytes

    if not Path(binary).exists():
        pytest.skip(f"no {binary}")
    server = RedisServer(Path(str(tmp_path)) / "r7", binary=binary).start()
    try:
        figures = paused_session_bytes(server.url, prefix, Path(str(tmp_path)) / "home")
    finally:
        server.stop(kill=True)
    keys = figures["paused_session_keys"]
    assert set(keys) == {"meta", "turns", "calls", "events", "versions", "pending", "token"}
    assert sum(keys.values()) <= 4_352, keys
    assert figures["paused_session_bytes"] <= 5 * 1024 + 256, figures


def test_a_user_not_allowed_restore_still_commits_the_step_that_waits(tmp_path: object, prefix: str) -> None:
    """RESTORE is in @dangerous: a `workers` user without it (docker-compose.yml's before it
    granted `+restore`) keeps its waiting sessions' streams as they are, and its steps commit."""
    from pathlib import Path

    users = ["--user", "default", "off", "--user", "workers", "on", ">pw", "~*", "&*", "+@all", "-@dangerous"]
    server = RedisServer(Path(str(tmp_path)) / "acl", extra=users, auth=("workers", "pw")).start()
    try:
        url = f"redis://workers:pw@127.0.0.1:{server.port}/0"
        settings = Settings(redis_url=url, prefix=prefix, home=Path(str(tmp_path)) / "home")
        with Client(settings, inline=True) as client:
            sid = client.start(parse_agent(AGENT), "Please book a table in Paris.").session_id
            client.step(sid)
            view = client.step(sid)
            assert view.state.value == "waiting" and view.error is None
            assert client.store.header(sid).version == 3
            assert client.store.client.memory_usage(client.store.keys.events(sid), samples=0) >= 4096
    finally:
        server.stop(kill=True)
