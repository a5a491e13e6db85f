"""What a paused session costs in Redis (bench key `paused_session_bytes`): the session waiting on
a deferred call, as bench/paused_memory.py measures it. Its header, its versions and its pending
calls stay compact hashes (listpacks), nothing is stored twice or at its default, and its events
are packed into one string when it starts to wait (a stream costs ~600 bytes before its first
entry, and Redis gives a new stream node 4 KB): read from there while it waits, put back into the
stream, under their ids, by its next event."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.harness import DEFER_AGENT
from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.errors import AgentsError
from celery_agents.store.codec import PACK_WORDS, event_from_entry
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


def test_a_paused_sessions_events_are_one_packed_value_read_as_the_stream_held_them(
    paused: tuple[Client, str],
) -> None:
    """Every event is `type`, `version`, `data` (Redis stores a stream's field names once per node
    when they are its first entry's, and only such events are packed); its time is its id's."""
    client, sid = paused
    r, keys = client.store.client, client.store.keys
    assert r.exists(keys.events(sid)) == 0 and r.type(keys.packed(sid)) == "string"
    assert r.memory_usage(keys.packed(sid), samples=0) < 512
    events = list(client.events(sid))
    assert [e["type"] for e in events] == [
        "session_started", "step_started", "llm_called", "step_committed", "step_started", "token_created",
        "step_committed",
    ]  # fmt: skip
    assert all(e["at"] == int(e["id"].split("-")[0]) / 1000 for e in events)
    assert events[-2]["tool"] == "book_table" and events[-1]["state"] == "waiting"
    assert client.store.last_event_id(sid) == events[-1]["id"]
    assert client.read_events(sid, events[3]["id"]) == events[4:], "read from any point, as from the stream"


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


def test_a_paused_sessions_events_come_back_as_they_were_whatever_their_text(tmp_path: Path, prefix: str) -> None:
    """What packing writes as one character (`PACK_WORDS`), pattern characters, text outside
    ASCII, and the deltas a streamed step wrote and its commit deleted: the events read while the
    session waits, and the stream its next event brings back, are the stream it had, under the
    same ids; the next id comes after every id the stream gave, deleted ones too."""
    server = RedisServer(tmp_path / "r", binary=REDIS_7 if Path(REDIS_7).exists() else None).start()
    settings = Settings(redis_url=server.url, prefix=prefix, home=tmp_path / "home")
    try:
        with Client(settings, inline=True) as client:
            sid = client.start(parse_agent(AGENT), "Please book a table in Paris.").session_id
            client.step(sid)
            r, key = client.store.client, client.store.keys.events(sid)
            text = '","tool":" PartialUserTurn %d %% ^$().[]*+-? é \\ \u2028 日本'
            tricky = json.dumps({"text": text}, ensure_ascii=False)
            r.xadd(key, {"type": "text_delta", "version": "2", "data": tricky})
            deltas = [r.xadd(key, {"type": "text_delta", "version": "2", "data": "{}"}) for _ in range(5)]
            r.xdel(key, *deltas)  # as the commit of a streamed step deletes them
            assert client.step(sid).state.value == "waiting"
            assert r.exists(key) == 0, "packed"
            read = client.read_events(sid)
            assert any(e.get("text", "").startswith('","tool":"') for e in read)
            (pending,) = client.pending(sid)
            assert pending.token is not None
            client.complete(pending.token, {"booked": True})
            back = r.xrange(key)
            assert [event_from_entry(eid, fields) for eid, fields in back[: len(read)]] == read
            assert back[len(read)][1]["type"] == "token_completed"
            newer = tuple(map(int, back[len(read)][0].split("-")))
            assert newer > tuple(map(int, deltas[-1].split("-"))), "no id is given twice"
            assert r.exists(client.store.keys.packed(sid)) == 0
    finally:
        server.stop(kill=True)


def test_a_session_whose_events_hold_much_text_keeps_its_stream(settings: Settings) -> None:
    """Packing passes over the text thirty times, Redis waiting meanwhile: a session with more
    than 4 KB of event text keeps its stream (whose cost is then a small part of it)."""
    with Client(settings, inline=True) as client:
        sid = client.start(parse_agent(AGENT), "Please book a table in Paris.").session_id
        client.step(sid)
        r, key = client.store.client, client.store.keys.events(sid)
        r.xadd(key, {"type": "text_delta", "version": "2", "data": json.dumps({"text": "x" * 4096})})
        assert client.step(sid).state.value == "waiting"
        assert r.exists(key) == 1 and r.exists(client.store.keys.packed(sid)) == 0
        assert [e["type"] for e in client.events(sid)][-1] == "step_committed"


def test_a_follower_of_a_waiting_session_wakes_with_its_next_event(paused: tuple[Client, str]) -> None:
    """A blocked read of a session whose stream is packed away waits on the stream's return."""
    client, sid = paused
    last = client.store.last_event_id(sid)
    got: list[list[dict[str, object]]] = []
    follower = threading.Thread(target=lambda: got.append(client.read_events(sid, last, block_ms=20_000)))
    started = time.monotonic()
    follower.start()
    (pending,) = client.pending(sid)
    assert pending.token is not None
    client.complete(pending.token, {"booked": True})
    follower.join(timeout=30)
    assert got and got[0] and got[0][0]["type"] == "token_completed"
    assert time.monotonic() - started < 15, "woken by the event, not by the end of its block"


def _blocked_reads(client: Client) -> int:
    return sum(1 for c in client.store.client.client_list() if c["cmd"] == "xread" and "b" in c["flags"])


def _until_a_read_blocks(client: Client, before: int) -> None:
    """Until one more client of this Redis than `before` is blocked in XREAD (what a test of a
    blocked read needs; other tests on the same Redis may hold blocked reads of their own)."""
    deadline = time.monotonic() + 10
    while _blocked_reads(client) <= before:
        assert time.monotonic() < deadline, "no read blocked"
        time.sleep(0.01)


def test_a_follower_blocked_when_the_session_starts_to_wait_gets_the_commits_events(settings: Settings) -> None:
    """The events are packed after the commit that leaves the session waiting, not in it: a read
    blocked on the stream is handed the commit's events (Redis hands them once the command that
    added them has run, and only from a stream that is still there)."""
    with Client(settings, inline=True) as client:
        sid = client.start(parse_agent(AGENT), "Please book a table in Paris.").session_id
        client.step(sid)
        seen: dict[str, float] = {}

        start = client.store.last_event_id(sid)

        def follow() -> None:
            after = start
            while "waiting" not in seen:
                for e in client.read_events(sid, after, block_ms=20_000):
                    after = e["id"]
                    if e["type"] == "step_committed" and e["state"] == "waiting":
                        seen["waiting"] = time.monotonic()

        follower = threading.Thread(target=follow)
        before = _blocked_reads(client)
        follower.start()
        _until_a_read_blocks(client, before)
        assert client.step(sid).state.value == "waiting"
        committed = time.monotonic()
        follower.join(timeout=40)
        assert "waiting" in seen and seen["waiting"] - committed < 5, "handed at the commit, not at the end of a block"
        assert client.store.client.exists(client.store.keys.events(sid)) == 0, "and packed after"


def test_events_written_while_the_session_waits_are_packed_with_the_rest(paused: tuple[Client, str]) -> None:
    """A deadline moved (`call_extended`) and a completion that changed nothing (`token_rejected`)
    bring the stream back for their event; the session still waits, and its events are packed
    again."""
    client, sid = paused
    r, keys = client.store.client, client.store.keys
    (pending,) = client.pending(sid)
    assert pending.token is not None
    client.extend(pending.token, 3600)
    with pytest.raises(AgentsError):
        client.complete(f"{sid}.{'A' * 24}", {"forged": True})
    assert r.exists(keys.events(sid)) == 0 and r.exists(keys.packed(sid)) == 1
    assert [e["type"] for e in client.events(sid)][-2:] == ["call_extended", "token_rejected"]


def test_a_packed_value_another_client_spoiled_does_not_stop_the_session(paused: tuple[Client, str]) -> None:
    client, sid = paused
    r, keys = client.store.client, client.store.keys
    for spoiled in ("1 12-0\nnot an id\nx\n1\n{}\n", "1 5-0\n\u00b2-0\nsession_started\n1\n{}\n"):
        r.set(keys.packed(sid), spoiled)
        assert client.read_events(sid) == []  # read as Lua reads it: an entry that is not, and the rest, left out
    assert client.read_events(sid, "18446744073709551615-18446744073709551615") == [], "the last id there may be"
    (pending,) = client.pending(sid)
    assert pending.token is not None
    client.complete(pending.token, {"booked": True})
    assert client.resume(sid).state.value == "completed"
    assert client.read_events(sid)[0]["type"] == "token_completed"


def test_the_words_packing_writes_as_one_character_are_the_same_in_lua_and_python() -> None:
    lua = (Path(__file__).parents[2] / "celery_agents/store/lua/_lib.lua").read_text()
    table = lua[lua.index("local PACK_WORDS = {") : lua.index("}\nlocal function pack_code")]
    words = [w.replace("\\n", "\n") for w in re.findall(r"'((?:[^'\\]|\\.)*)'", table)]
    assert tuple(words) == PACK_WORDS and len(PACK_WORDS) == 30
    assert list(PACK_WORDS) == sorted(PACK_WORDS, key=len, reverse=True)


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
def test_on_redis_7_a_paused_session_costs_at_most_4_kb(binary: str, tmp_path: object, prefix: str) -> None:
    """The whole of it, as the bench counts it: MEMORY USAGE of its keys, and what its index
    entries add to indexes big enough to be Redis's large encodings (~600-650: they vary with the
    levels Redis draws for their skiplist nodes)."""
    from bench.paused_memory import paused_session_bytes

    if not Path(binary).exists():
        pytest.skip(f"no {binary}")
    server = RedisServer(Path(str(tmp_path)) / "r7", binary=binary).start()
    try:
        figures = paused_session_bytes(server.url, prefix, Path(str(tmp_path)) / "home")
    finally:
        server.stop(kill=True)
    keys = figures["paused_session_keys"]
    assert set(keys) == {"meta", "turns", "calls", "packed", "versions", "pending", "token"}
    assert sum(keys.values()) <= 3_400, keys
    assert figures["paused_session_bytes"] <= 4 * 1024, figures


def test_a_user_not_allowed_dangerous_commands_packs_a_waiting_sessions_events(tmp_path: object, prefix: str) -> None:
    """Packing needs nothing of @dangerous (no DUMP or RESTORE): a `workers` user without it
    commits the step that waits and its session's events are packed all the same."""
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
            r, keys = client.store.client, client.store.keys
            assert r.exists(keys.events(sid)) == 0 and r.memory_usage(keys.packed(sid), samples=0) < 512
            assert [e["type"] for e in client.events(sid)][-1] == "step_committed"
    finally:
        server.stop(kill=True)
