"""The sweeper's scripts decide exactly as the one rule, `model.recovery.recovery_decision`, for
every combination of what is known of an owed step or a dispatched call; and `agents doctor`'s
"worker died" count is that rule too."""

from __future__ import annotations

import itertools
import time

import pytest

from celery_agents.model.recovery import Entry, Recovery, recovery_decision, worker_died
from celery_agents.store import Store
from tests.store.scenario import begin, start, waiting_on

COMBINATIONS = [Entry(*flags) for flags in itertools.product((False, True), repeat=4)]


def _owed_step(store: Store, entry: Entry) -> str:
    sid = start(store, drive="auto", owe=True)
    meta = store.keys.meta(sid)
    if not entry.owed:
        store.client.hset(meta, "owed_version", "0")
    if entry.picked:
        store.client.hset(meta, "picked", store.header(sid).version)
    if entry.leased:
        store.client.set(store.keys.lease(sid), "some-worker", ex=30)
    return sid


def _dispatched_call(any_store: Store, entry: Entry) -> tuple[str, str]:
    sid, calls = waiting_on(any_store, ("c1", "async_t"))
    field = calls[0].field
    if not entry.owed:
        any_store.client.hdel(any_store.keys.pending(sid), field)
    if entry.picked:
        any_store.mark_call_started(sid, field, "some-worker")
    if entry.leased:
        any_store.client.set(any_store.keys.call_lease(sid, field), "some-worker", ex=30)
    return sid, field


@pytest.mark.parametrize("entry", COMBINATIONS, ids=repr)
def test_the_owed_step_sweep_decides_as_the_recovery_rule(any_store: Store, entry: Entry) -> None:
    sid = _owed_step(any_store, entry)
    [swept] = any_store.sweep_owed([(sid, entry.lost)], time.time())
    assert swept.verdict is recovery_decision(entry)


@pytest.mark.parametrize("entry", COMBINATIONS, ids=repr)
def test_the_dispatched_call_sweep_decides_as_the_recovery_rule(any_store: Store, entry: Entry) -> None:
    sid, field = _dispatched_call(any_store, entry)
    [swept] = any_store.sweep_dispatched([(sid, field, entry.lost)], time.time())
    assert swept.verdict is recovery_decision(entry)


def test_doctor_reads_each_entry_as_the_sweeper_judges_it(any_store: Store) -> None:
    """`due_entries` (what doctor counts with `worker_died`) sees what the scripts see."""
    made = [e for e in COMBINATIONS if not e.lost]
    for entry in made:
        _owed_step(any_store, entry)
        _dispatched_call(any_store, entry)
    any_store.client.zadd(
        any_store.keys.dispatched,
        {f"{sid} {f}": 0 for sid, f in _pending_members(any_store)},
    )
    read = any_store.due_entries(time.time() + 1)
    owed_read, calls_read = read[: len(made)], read[len(made) :]
    assert sorted(map(repr, owed_read)) == sorted(map(repr, made))
    assert sum(map(worker_died, calls_read)) == sum(map(worker_died, made)) == 1


def _pending_members(store: Store) -> list[tuple[str, str]]:
    """Every call a test session made (pending or not), as `dispatched` members."""
    out = []
    for sid in store._newest(None, 1000):
        out += [(sid, f) for f in store.client.hkeys(store.keys.calls(sid))]
    return out


def test_only_a_picked_up_entry_whose_lease_lapsed_counts_as_a_dead_worker() -> None:
    assert [e for e in COMBINATIONS if worker_died(e) and not e.lost] == [Entry(owed=True, leased=False, picked=True)]
    assert recovery_decision(Entry(owed=True, leased=False, picked=False, lost=True)) is Recovery.REPUBLISH


def test_an_owed_step_whose_worker_began_it_and_died_is_published_again(any_store: Store) -> None:
    sid = start(any_store, drive="auto", owe=True)
    begin(any_store, sid, "worker-a")
    any_store.client.delete(any_store.keys.lease(sid))  # worker-a died: its lease lapsed
    [swept] = any_store.sweep_owed([(sid, False)], time.time())
    assert (swept.verdict, swept.version) == (Recovery.REPUBLISH, 1)


def test_a_step_nobody_owes_is_not_marked_picked_up_and_then_owed_it_waits_for_its_message(any_store: Store) -> None:
    """`picked` is only ever read of an owed step, and owing a step clears it: a step not owed when
    it begins does not write it, and the sweeper judges it by its queue once it is owed."""
    sid = start(any_store)
    begin(any_store, sid, "worker-a")
    assert any_store.client.hget(any_store.keys.meta(sid), "picked") is None
    any_store.prepare_step(sid)  # owed now (`session step`), while worker-a runs it
    any_store.client.delete(any_store.keys.lease(sid))
    [swept] = any_store.sweep_owed([(sid, False)], time.time())
    assert swept.verdict is Recovery.WAITING
