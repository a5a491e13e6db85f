"""A step's Redis commands: `begin_step` and `commit_step` must not grow with what a step adds,
and the one step of a session whose model answers at once costs 18 commands (docs/performance.md,
"What bounds them": the two round trips).

Counted with INFO commandstats on the real Redis (commands run inside the scripts included), around
the begin and the commit of the step that dispatches the tool calls the model asked for (an
agent running the tools inline): twenty calls cost one command more per extra call than one
call (the call's event), not one per key the call touches.

INFO commandstats counts every client's commands, so the module runs on a Redis of its own: on the
run's shared one, other tests' commands landed between the two counts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from celery_agents.config import Settings
from celery_agents.store import Store, client_for_url
from tests.scheduler.fakes import ScriptedLlm, llm_turn
from tests.store.scenario import commit, decide, start, step
from tests.support.redis_server import RedisServer


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("own-redis")).start()
    yield server
    server.stop(kill=True)


@pytest.fixture
def store(own_redis: RedisServer, settings: Settings) -> Iterator[Store]:
    client = client_for_url(own_redis.url)
    yield Store(client, replace(settings, redis_url=own_redis.url))
    client.close()


def _commands(store: Store) -> int:
    stats = store.client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")


def _model_step_commands(store: Store) -> tuple[int, int]:
    """The begin and the commit of the one step of a session whose model answers at once (the
    session `bench/run.py` counts: no tools, manual drive)."""
    sid = start(store)
    before = _commands(store)
    begun_step = store.begin_step(sid, 1, "w1", request="test")
    begun = _commands(store)
    loaded = begun_step.loaded
    assert loaded is not None, begun_step
    t = decide(store, loaded, llm=ScriptedLlm(llm_turn(text="Sunny.")))
    done = commit(store, sid, loaded, t)
    committed = _commands(store)
    assert done.outcome == "ok", done
    assert store.header(sid).status.value == "completed"
    return begun - before, committed - begun


def _step_commands(store: Store, n_calls: int) -> tuple[int, int]:
    sid = start(store)
    calls = [(f"call_{i:04d}", "sync_a", '{"city": "Paris"}') for i in range(n_calls)]
    step(store, sid, ScriptedLlm(llm_turn(*calls, text="Checking.")))
    before = _commands(store)
    begun_step = store.begin_step(sid, 2, "w1", request="test")
    begun = _commands(store)
    loaded = begun_step.loaded
    assert loaded is not None, begun_step
    t = decide(store, loaded)
    assert len(t.calls) == n_calls
    done = commit(store, sid, loaded, t)
    assert done.outcome == "ok", done
    return begun - before, _commands(store) - begun


def test_each_extra_tool_call_of_a_step_costs_one_command_its_event(store: Store) -> None:
    _step_commands(store, 1)  # scripts loaded before counting
    begin_one, commit_one = _step_commands(store, 1)
    begin_twenty, commit_twenty = _step_commands(store, 20)
    assert begin_twenty == begin_one
    assert commit_twenty - commit_one <= 19


def test_a_step_begins_and_commits_in_few_commands(store: Store) -> None:
    _step_commands(store, 1)
    begin_commands, commit_commands = _step_commands(store, 1)
    # begin_step: EVALSHA, HGETALL, SET (lease), XADD (step_started: its id is the script's time, no
    # TIME), HGETALL (journal: a tools step); no LRANGE: this process has every turn cached
    assert begin_commands <= 5
    # commit_step of a tools step with one call: EVALSHA, HMGET, GETDEL (lease), XADD (tool_finished,
    # step_committed: the first one's id is the script's time, no TIME), RPUSH, HSET (calls), HSET
    # (header), HSET (the version's entry, `session history`), ZREM, ZADD (sessions, state), DEL
    # (journal), HINCRBY (the step's outcome; the scripted ports here count no model call or tool
    # run); see docs/performance.md
    assert commit_commands <= 14


def test_a_one_step_session_begins_and_commits_in_few_commands(store: Store) -> None:
    _model_step_commands(store)
    begin_commands, commit_commands = _model_step_commands(store)
    # begin_step: EVALSHA, HGETALL, SET (lease), XADD (step_started), LRANGE (turns)
    assert begin_commands <= 5
    # commit_step: EVALSHA, HMGET, GETDEL (lease), XADD (llm_called, completed, step_committed), RPUSH,
    # HSET (the header, with the session's spend), HSET (the version's entry), ZREM, ZADD (sessions,
    # state), RPUSH (the step's outcome and the fleet's spend: the model call's tokens)
    assert commit_commands <= 13


def test_a_step_adds_all_it_counted_to_the_fleet_s_counters_in_one_command(store: Store) -> None:
    """The step's outcome, model calls, tokens by kind, inline tool calls and spend cost the commit
    no more commands than its outcome alone: they go to the fleet's counters in one RPUSH to a short
    list (folded into the hash by the 64th)."""
    from celery_agents.store.commit import commit_record
    from tests.store.scenario import begin

    counted = {
        ("model_calls", "m", "ok"): 1,
        ("model_tokens", "m", "input"): 15,
        ("model_tokens", "m", "output"): 12,
        ("tool_calls", "lookup", "runSync", "completed"): 2,
    }

    def commit_commands(counts: dict[tuple[str, ...], int]) -> int:
        sid = start(store)
        loaded = begin(store, sid)
        t = decide(store, loaded, llm=ScriptedLlm(llm_turn(text="Sunny.")))
        record = commit_record(loaded.header, "w1", t, counts=counts)
        keys = store.scripts.session_keys("commit_step", store.keys, sid, sid)
        before = _commands(store)
        reply = store.scripts.run("commit_step", keys, ["event", 1000, sid, *record.to_args(sid, 30_000)])
        assert reply[0] == "ok"
        return _commands(store) - before

    commit_commands({})  # the script loaded before counting
    assert [commit_commands(counted) for _ in range(3)] == [commit_commands({})] * 3
    got = store.counters()
    assert got[("model_tokens", "m", "input")] == 45 and got[("tool_calls", "lookup", "runSync", "completed")] == 6


def test_step_started_has_redis_s_time_from_its_stream_id_and_the_step_stamps_with_it(store: Store) -> None:
    sid = start(store)
    before = store.server_time()
    begun = store.begin_step(sid, 1, "w1", request="test")
    after = store.server_time()
    assert begun.loaded is not None
    started = [e for e in store.read_events(sid) if e["type"] == "step_started"]
    assert len(started) == 1
    raw = store.client.xrange(store.keys.events(sid), min=started[0]["id"], max=started[0]["id"])
    assert "at" not in raw[0][1]  # written without it: its id is its time
    # whole milliseconds of Redis's clock, as TIME gave before
    assert int(before * 1000) / 1000 <= started[0]["at"] <= after
    assert started[0]["at"] == int(started[0]["id"].split("-")[0]) / 1000
    assert begun.loaded.redis_now == started[0]["at"]
