"""A step trusts its lease until a local deadline (its last renewal's start plus the lease, less a
third), and past it asks Redis before it acts: a lease another worker took, or a session that
moved on, stops it however late the renewal thread is; a lease that lapsed with nobody taking it
(Redis was away) is taken back."""

from __future__ import annotations

import time
from typing import Any

import pytest

from celery_agents.runtime.lease import MARGIN, LeaseKeeper
from celery_agents.store import Store
from tests.scheduler.fakes import ScriptedLlm, llm_turn
from tests.store.scenario import begin, commit, decide, start


def keeper(store: Store, sid: str, owner: str, taken_at: float) -> LeaseKeeper:
    """A step's lease keeper whose renewal thread never runs (as after a freeze: not entered)."""
    return LeaseKeeper(store, store.keys.lease(sid), owner, header=store.keys.meta(sid), version=1, taken_at=taken_at)


@pytest.fixture
def renewals(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every lease renewal sent to Redis."""
    sent: list[Any] = []
    renew = store.renew_leases

    def counted(held: list[Any]) -> Any:
        sent.extend(held)
        return renew(held)

    monkeypatch.setattr(store, "renew_leases", counted)
    return sent


def test_before_its_deadline_a_step_asks_redis_nothing(store: Store, renewals: list[Any]) -> None:
    sid = start(store)
    begin(store, sid, "worker-a")
    lease = keeper(store, sid, "worker-a", taken_at=time.monotonic())
    assert all(lease.holds() for _ in range(100))
    assert renewals == []


def test_past_its_deadline_a_step_whose_lease_another_worker_took_stops(store: Store, renewals: list[Any]) -> None:
    sid = start(store)
    begin(store, sid, "worker-a")
    frozen_since = time.monotonic() - store.settings.lease_seconds * (1 - MARGIN)
    lease = keeper(store, sid, "worker-a", taken_at=frozen_since)
    store.client.set(store.keys.lease(sid), "worker-b")  # it lapsed during the freeze; worker-b took it
    assert not lease.holds()
    assert len(renewals) == 1
    assert not lease.holds() and len(renewals) == 1, "lost is lost: Redis is not asked again"
    assert store.lease_holder(sid) == "worker-b"


def test_past_its_deadline_a_step_whose_session_moved_on_stops(store: Store) -> None:
    sid = start(store)
    loaded = begin(store, sid, "worker-a")
    lease = keeper(store, sid, "worker-a", taken_at=time.monotonic() - store.settings.lease_seconds)
    # Another worker took the lapsed lease and committed the step (which let the lease go).
    store.client.delete(store.keys.lease(sid))
    taken_over = begin(store, sid, "worker-b")
    assert commit(store, sid, taken_over, decide(store, loaded, ScriptedLlm(llm_turn(text="done"))), "worker-b")
    assert store.lease_holder(sid) is None
    assert not lease.holds()
    assert store.lease_holder(sid) is None


def test_past_its_deadline_a_step_takes_back_a_lease_that_lapsed_untaken(store: Store, renewals: list[Any]) -> None:
    sid = start(store)
    begin(store, sid, "worker-a")
    lease = keeper(store, sid, "worker-a", taken_at=time.monotonic() - store.settings.lease_seconds)
    store.client.delete(store.keys.lease(sid))  # lapsed while Redis was away
    assert lease.holds() and lease.retaken
    assert store.lease_holder(sid) == "worker-a"
    assert lease.holds() and len(renewals) == 1, "trusted again until its new deadline"
