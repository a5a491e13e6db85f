"""The fleet's counters are counted by the scripts that record the work, in Redis: a step's commit
counts the step, its model call and tokens and its inline tool calls; a completion, an expiry, a
dispatched call's result and the sweeper's republish count theirs; each exactly once, whichever
process (or how many of them) did the work."""

from __future__ import annotations

import itertools
import json
import time

import pytest

from celery_agents.errors import TokenAlreadyCompleted
from celery_agents.llm.adapter import LitellmPort
from celery_agents.model import UserQuery
from celery_agents.observe.metrics import counter_families
from celery_agents.runtime import run_step
from celery_agents.runtime.completions import CompletionConsumer, complete
from celery_agents.store import Store, completion_json
from celery_agents.tools.resolve import parse_agent
from tests.scheduler.fakes import RecordingTools, ScriptedLlm, llm_turn
from tests.store.scenario import begin, start, token_of, waiting_on

DAY = 86400

#: the offline demo model, called through litellm, asks for the weather tools it is offered
WEATHER = parse_agent(
    {
        "slug": "weather",
        "model": "demo/counted",
        "tools": [
            {"name": "get_weather", "command": ["echo", '{"temp": 21}']},
            {"name": "get_forecast", "command": ["echo", '{"rain": false}']},
        ],
        "toolCallPolicy": {"default": "runSync"},
    }
)


def counters(store: Store) -> dict[tuple[str, ...], int]:
    """What any process reads: a fresh store on the same Redis."""
    return Store(store.client, store.settings).counters()


def test_a_step_counts_its_outcome_model_call_tokens_and_inline_tool_calls_in_redis(store: Store) -> None:
    sid = store.create_session(WEATHER, UserQuery(text="What is the weather in Paris?")).session_id
    llm, tools = LitellmPort(), RecordingTools()
    assert run_step(store, sid, 1, llm=llm, tools=tools, owner="w1").outcome == "committed"
    first = counters(store)
    assert first[("steps", "committed")] == 1
    assert first[("model_calls", "demo/counted", "ok")] == 1
    assert first[("model_tokens", "demo/counted", "input")] > 0
    assert first[("model_tokens", "demo/counted", "output")] > 0
    assert not [k for k in first if k[0] == "tool_calls"], "no tool has run yet"
    # The second step runs the calls the model asked for, inline, and commits them with their counts.
    assert run_step(store, sid, 2, llm=llm, tools=tools, owner="w1").outcome == "committed"
    ran = {c.tool for c in tools.runs}
    assert ran
    after = counters(store)
    for tool in ran:
        assert after[("tool_calls", tool, "runSync", "completed")] == 1
    assert after[("steps", "committed")] == 2


def test_a_step_refused_at_its_start_counts_as_its_outcome(store: Store) -> None:
    sid = start(store)
    begin(store, sid, owner="w1")
    llm, tools = ScriptedLlm(), RecordingTools()
    assert run_step(store, sid, 1, llm=llm, tools=tools, owner="w2").outcome == "busy"
    assert run_step(store, sid, 7, llm=llm, tools=tools, owner="w2").outcome == "stale"
    got = counters(store)
    assert (got[("steps", "busy")], got[("steps", "stale")]) == (1, 1)
    assert ("steps", "committed") not in got


def test_a_deferred_call_is_counted_once_however_often_it_is_completed(store: Store) -> None:
    _, calls = waiting_on(store, ("c1", "defer_t"), ("c2", "defer_t"))
    complete(store, token_of(calls, "c1"), {"approved": True}, by="alice")
    complete(store, token_of(calls, "c2"), "no budget", is_error=True, by="bob")
    with pytest.raises(TokenAlreadyCompleted):
        complete(store, token_of(calls, "c1"), {"approved": False})
    got = counters(store)
    assert got[("completions", "applied")] == 2
    assert got[("tool_calls", "defer_t", "defer", "completed")] == 1
    assert got[("tool_calls", "defer_t", "defer", "failed")] == 1


def test_a_stream_entry_that_changes_nothing_is_counted_by_its_reason(store: Store) -> None:
    _, calls = waiting_on(store, ("c1", "defer_t"))
    token = token_of(calls, "c1")
    stream = store.keys.completions
    store.client.xadd(stream, {"token": token, "result": '"yes"'})
    store.client.xadd(stream, {"token": token, "result": '"again"'})
    store.client.xadd(stream, {"result": '"no token"'})
    consumer = CompletionConsumer(store, "c")
    assert consumer.poll() == 3
    got = counters(store)
    assert got[("completions", "applied")] == 1
    assert got[("completions", "token_already_completed")] == 1
    assert got[("completions", "invalid_result")] == 1
    assert got[("tool_calls", "defer_t", "defer", "completed")] == 1


def test_an_expired_deferred_call_is_counted_once(store: Store) -> None:
    sid, calls = waiting_on(store, ("c1", "defer_t"))
    later = time.time() + DAY + 60
    assert store.expire_call(sid, calls[0].field, now=later).status == "ok"
    assert store.expire_call(sid, calls[0].field, now=later).status == "gone"
    assert counters(store)[("tool_calls", "defer_t", "defer", "expired")] == 1


def test_a_dispatched_call_s_counts_are_added_by_the_writer_that_records_it(store: Store) -> None:
    sid, calls = waiting_on(store, ("c1", "async_t"))
    f = calls[0].field
    body = completion_json("done", is_error=False, by="", now=time.time())
    ran = {("tool_calls", "async_t", "runAsync", "completed"): 1}
    assert store.record_result(sid, f, body, {}, counts=ran).status == "ok"
    assert store.record_result(sid, f, body, {}, counts=ran).status == "already"
    assert counters(store)[("tool_calls", "async_t", "runAsync", "completed")] == 1


def test_the_sweeper_s_republish_is_counted_and_a_lapsed_lease_as_a_takeover(store: Store) -> None:
    now = time.time()
    unpicked = start(store, drive="auto", owe=True, now=now - 60)
    picked = start(store, drive="auto", owe=True, now=now - 60)
    begin(store, picked, owner="dead-worker")
    store.client.delete(store.keys.lease(picked))  # its worker died: the lease lapsed
    swept = store.sweep_owed([(unpicked, True), (picked, False)], now)
    assert [s.verdict.value for s in swept] == ["republish", "republish"]
    got = counters(store)
    assert got[("republished", "step")] == 2
    assert got[("lease_takeovers", "step")] == 1


def test_every_series_is_served_with_its_labels_and_the_quiet_ones_at_zero() -> None:
    families = {
        f.name: f
        for f in counter_families(
            {
                ("tool_calls", "lookup", "defer", "completed"): 3,
                ("completions", "applied"): 3,
                ("tool_calls", "too", "few"): 1,  # a shape another release wrote: left out
                ("unknown_series", "x"): 1,
            }
        )
    }
    [tool] = families["agents_tool_calls"].samples
    assert (tool.name, tool.labels, tool.value) == (
        "agents_tool_calls_total",
        {"tool": "lookup", "disposition": "defer", "outcome": "completed"},
        3,
    )
    assert {s.labels["kind"]: s.value for s in families["agents_republished"].samples} == {"call": 0, "step": 0}
    assert [s.value for s in families["agents_sandbox_oom_kills"].samples] == [0]
    assert "agents_unknown_series" not in families


def test_counts_travel_to_a_script_as_fields_it_adds(store: Store) -> None:
    from celery_agents.store.counters import counts_json

    assert json.loads(counts_json({("model_calls", "a\x1fb", "ok"): 2, ("steps", "noop"): 0})) == [
        ["model_calls\x1fa b\x1fok", 2]
    ]
    store.count({("steps", "lost"): 1, ("model_calls", "m", "ok"): 2})
    assert counters(store) == {("steps", "lost"): 1, ("model_calls", "m", "ok"): 2}


def test_nothing_is_counted_for_a_step_s_commit_retried_after_its_reply_was_lost(store: Store) -> None:
    from celery_agents.store.commit import commit_record
    from tests.store.scenario import decide

    sid = start(store)
    loaded = begin(store, sid)
    t = decide(store, loaded, llm=ScriptedLlm(llm_turn(text="Sunny.")))
    record = commit_record(loaded.header, "w1", t, counts={("model_calls", "m", "ok"): 1})
    args = record.to_args("attempt-1", 30_000)
    for _ in range(2):  # the client sends the same call again: the script answers with the first reply
        reply = store.scripts.run(
            "commit_step",
            store.scripts.session_keys("commit_step", store.keys, sid, "attempt-1"),
            ["event", 1000, sid, *args],
        )
        assert reply[0] == "ok"
    # The model turn's tokens are the fleet's spend (`agents_spend_total{kind="tokens"}`), counted once too.
    tokens = t.spend.tokens
    assert counters(store) == {("steps", "committed"): 1, ("model_calls", "m", "ok"): 1, ("spend", "tokens"): tokens}


def _commit_counted(store: Store, counts: dict[tuple[str, ...], int], cost: float | None = None) -> None:
    from celery_agents.model import Usage
    from celery_agents.store.commit import commit_record
    from tests.store.scenario import decide

    sid = start(store)
    loaded = begin(store, sid)
    usage = Usage(prompt_tokens=10, completion_tokens=2, total_tokens=12, cost=cost)
    t = decide(store, loaded, llm=ScriptedLlm(llm_turn(text="Sunny.", usage=usage)))
    record = commit_record(loaded.header, "w1", t, counts=counts)
    keys = store.scripts.session_keys("commit_step", store.keys, sid, sid)
    reply = store.scripts.run("commit_step", keys, ["event", 1000, sid, *record.to_args(sid, 30_000)])
    assert reply[0] == "ok"


def test_counts_added_in_one_command_stay_exact_as_the_writes_that_fill_their_list_fold_it(store: Store) -> None:
    """A commit adds its several counts with one RPUSH to a short list, which the write that fills
    it adds to the hash: every reader sees the sum of both, exact after as many folds as it takes."""
    tally = store.keys.tally
    lengths = []
    for i in range(150):
        _commit_counted(store, {("model_calls", "m", "ok"): 1, ("model_tokens", "m", "input"): i})
        lengths.append(store.client.llen(tally))
        if i in (10, 63, 64, 149):
            got = counters(store)
            assert got[("steps", "committed")] == i + 1
            assert got[("model_calls", "m", "ok")] == i + 1
            assert got[("model_tokens", "m", "input")] == sum(range(i + 1))
            assert got[("spend", "tokens")] == 12 * (i + 1)
    assert max(lengths) < 64, "the write that fills the list folds it"
    assert lengths.count(0) == 2, lengths  # folded twice in 150 commits
    held = store.client.hgetall(store.keys.counters)
    assert int(held["steps\x1fcommitted"]) == 128, "two folds of 64 commits each are in the hash"


@pytest.mark.parametrize("seed", [1, 4, 6])  # costs under which a folded sum once read lower
def test_the_fleet_s_spend_in_usd_only_grows_and_is_the_sessions_spend(store: Store, seed: int) -> None:
    """`agents_spend_total{kind="cost"}` is a Prometheus counter: no read is lower than the one
    before it, across the folds of the counts' list too (steps without a cost fill the list: a sum
    of costs folded from it could read lower than the same sum read from it); and it is
    what the sessions spent."""
    import random

    rng, seen, spent = random.Random(seed), [], 0.0
    for i in range(200):
        cost = rng.uniform(1e-6, 3e-2) if i % 64 < 40 else None
        spent += cost or 0.0
        _commit_counted(store, {("model_calls", "m", "ok"): 1}, cost=cost)
        seen.append(counters(store).get(("spend", "cost"), 0.0))
    lower = [(a, b) for a, b in itertools.pairwise(seen) if b < a]
    assert not lower, f"a read lower than the one before it: {lower}"
    assert seen[-1] == pytest.approx(spent, rel=1e-12)


def test_a_malformed_tally_entry_counts_nothing_and_stops_no_write(store: Store) -> None:
    """Nothing but the store's scripts writes the list; what else lands there is skipped alike by
    the readers and by the fold, and the writes that fold it go on."""
    _commit_counted(store, {("model_calls", "m", "ok"): 2})
    store.client.rpush(
        store.keys.tally,
        "not json",
        '{"a": 1}',
        json.dumps([["steps\x1fcommitted", "x"], ["steps\x1fcommitted", 1.5], 7, ["model_calls\x1fm\x1fok", 3]]),
    )
    got = counters(store)
    assert got[("model_calls", "m", "ok")] == 5 and got[("steps", "committed")] == 1
    for _ in range(70):  # through a fold
        _commit_counted(store, {("model_calls", "m", "ok"): 1})
    got = counters(store)
    assert got[("model_calls", "m", "ok")] == 75 and got[("steps", "committed")] == 71


def test_a_field_the_hash_holds_as_no_whole_number_costs_the_fold_no_other_count(store: Store) -> None:
    store.client.hset(store.keys.counters, "model_calls\x1fbroken\x1fok", "1.5")
    for _ in range(70):
        _commit_counted(store, {("model_calls", "broken", "ok"): 1, ("model_tokens", "m", "input"): 2})
    got = counters(store)
    assert got[("steps", "committed")] == 70 and got[("model_tokens", "m", "input")] == 140


def test_counts_of_sessions_on_several_index_shards_are_read_from_all_of_them(store: Store) -> None:
    """With `AGENTS_INDEX_SHARDS` (a Cluster's default is 16, a single Redis may have several too)
    each shard counts its sessions' work: a read adds every shard's hash and list."""
    from dataclasses import replace

    sharded = Store(store.client, replace(store.settings, index_shards=4))
    for _ in range(24):
        _commit_counted(sharded, {("model_calls", "m", "ok"): 1, ("model_tokens", "m", "input"): 5})
    used = [k for k in sharded.keys.all_shards() if sharded.client.llen(k.tally)]
    assert len(used) > 1, "the sessions' counts are on several shards"
    got = Store(store.client, replace(store.settings, index_shards=4)).counters()
    assert got[("steps", "committed")] == 24 and got[("model_tokens", "m", "input")] == 120
