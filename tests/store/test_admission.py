"""The admission script's arithmetic (store/lua/admit.lua, release.lua), on real Redis and on
fakeredis: calls spaced by the rate with a second's burst, each waiting call booked a start time of
its own, tokens estimated then corrected, slots under a concurrency limit given back or lapsing,
a paused model, and two limits of which only the binding one is booked."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

import pytest

from celery_agents.model.admission import ModelLimit
from celery_agents.store import Store
from celery_agents.store.admission import Admission, HeldCall
from celery_agents.store.records import Waiter
from celery_agents.tools.resolve import parse_agent


def admit(store: Store, keys: list[str], tokens: int = 0, model: str = "m", session: str = "") -> Admission:
    sid = session or uuid.uuid4().hex
    return store.admit(model, keys, tokens, f"{sid}:1:slot", Waiter(sid, 1, 5))


def state(store: Store, key: str) -> dict[str, str]:
    return store.client.hgetall(store.keys.limit_state(key))  # type: ignore[return-value]


def test_calls_are_spaced_by_the_rate_after_a_seconds_burst_each_booked_its_own_start(any_store: Store) -> None:
    for attempt in range(3):  # the six calls must come within 500 ms (Redis's clock); a stalled machine tries again
        key = f"m{attempt}"
        any_store.set_limit(key, ModelLimit(rpm=120))  # one call per 500 ms, a second's worth (2) at once
        first, second = admit(any_store, [key]), admit(any_store, [key])
        assert first.admitted and second.admitted
        waits = [admit(any_store, [key]) for _ in range(4)]
        if waits[-1].now - first.now < 0.45:
            break
    assert all(not w.admitted and w.reason == "rate" and w.key == key for w in waits), waits
    starts = [w.until - first.now for w in waits]
    # the third call conforms 500 ms after the first; each later one 500 ms after the one before
    assert starts == pytest.approx([0.5, 1.0, 1.5, 2.0], abs=0.01)


def test_a_booked_call_starts_at_its_time_and_is_not_counted_twice(any_store: Store) -> None:
    for attempt in range(3):  # the eleven calls must come within 100 ms; a stalled machine tries again
        key = f"m{attempt}"
        any_store.set_limit(key, ModelLimit(rpm=600))  # 100 ms apart, ten at once
        sid = uuid.uuid4().hex
        first = [admit(any_store, [key]) for _ in range(10)]
        assert all(a.admitted for a in first)
        booked = admit(any_store, [key], session=sid)
        tat = float(state(any_store, key)["req_tat"])
        again = admit(any_store, [key], session=sid)  # back too early: the same start, nothing booked again
        if again.now - first[0].now < 0.09:
            break
    assert not booked.admitted
    assert (again.admitted, again.until) == (False, pytest.approx(booked.until, abs=1e-3))
    assert float(state(any_store, key)["req_tat"]) == tat
    time.sleep(max(0.0, booked.until - again.now) + 0.01)  # its start time comes (Redis's clock)
    assert admit(any_store, [key], session=sid).admitted
    assert float(state(any_store, key)["req_tat"]) == tat, "its cost was counted when it was booked"
    assert not any_store.client.exists(any_store.keys.limit_booking(sid, 1)), "the booking is used up"


def test_tokens_are_estimated_before_and_corrected_after(any_store: Store) -> None:
    any_store.set_limit("m", ModelLimit(tpm=60_000))  # a token per ms, a second's worth: 1,000
    big = admit(any_store, ["m"], tokens=5000)
    assert big.admitted, "a call of more than a second's worth starts on an empty bucket"
    after = admit(any_store, ["m"], tokens=100)
    assert not after.admitted and after.reason == "rate"
    # 5,000 tokens at a token per ms; the 100 tokens fit in the burst once the bucket is down to 900
    assert after.until - big.now == pytest.approx(5.0 - 0.9, abs=0.01)
    tat = float(state(any_store, "m")["tok_tat"])
    any_store.release(HeldCall("m", ("m",), "s", estimate=5000, delta=-3000))  # it used 2,000
    assert float(state(any_store, "m")["tok_tat"]) == pytest.approx(tat - 3000, abs=0.01)
    usage = any_store.limit_usages(["m"])[0]
    assert (usage.requests_this_minute, usage.tokens_this_minute) == (1, 2000)


def test_a_booked_call_starts_later_by_what_the_calls_before_it_used_above_their_estimates(
    any_store: Store,
) -> None:
    """Calls booked at their estimates' pace start no sooner than the usage the calls before them
    reported allows (booked starts kept as they were let a fleet spend several times its `tpm`
    when calls used more than estimated): ten calls that each used 2,000 tokens where 1,000 were
    estimated push the call booked behind them back by those 10,000 tokens' time."""
    for attempt in range(3):  # the eleven calls must come within 100 ms; a stalled machine tries again
        key = f"m{attempt}"
        any_store.set_limit(key, ModelLimit(tpm=600_000))  # ten tokens per ms, a second's worth: 10,000
        first = [admit(any_store, [key], tokens=1000) for _ in range(10)]
        sid = uuid.uuid4().hex
        booked = admit(any_store, [key], tokens=1000, session=sid)
        if booked.now - first[0].now < 0.09:
            break
    assert all(a.admitted for a in first)
    assert not booked.admitted and booked.reason == "rate"
    assert booked.until - first[0].now == pytest.approx(0.1, abs=0.02)
    for _ in first:
        any_store.release(HeldCall(key, (key,), "s", estimate=1000, delta=1000))
    time.sleep(max(0.0, booked.until - booked.now) + 0.01)  # its start time comes (Redis's clock)
    back = admit(any_store, [key], tokens=1000, session=sid)
    assert not back.admitted and back.reason == "rate", "the others' usage came first"
    assert back.until - back.now == pytest.approx(1.0, abs=0.05)  # 10,000 tokens at ten per ms
    time.sleep(max(0.0, back.until - back.now) + 0.01)
    assert admit(any_store, [key], tokens=1000, session=sid).admitted


def test_calls_that_use_more_than_estimated_keep_the_fleet_within_its_tokens_per_second(any_store: Store) -> None:
    """Forty calls estimated at 1,000 tokens that each use 5,000, under 6,000,000 tokens a minute
    (100 per ms) with a tenth of a second's burst: whatever second one looks at, the tokens of the
    calls started in it stay within the rate, its burst and one call's misestimate (each call
    reports its usage as it starts, as if it answered at once). Booked starts kept as they were
    let all forty start within 0.4 s: 200,000 tokens where 100,000 a second are allowed."""
    store = Store(any_store.client, replace(any_store.settings, limits_burst=0.1))
    store.set_limit("m", ModelLimit(tpm=6_000_000))
    waiting = {uuid.uuid4().hex: 0.0 for _ in range(40)}
    started: list[float] = []
    while waiting:
        sid, at = min(waiting.items(), key=lambda kv: kv[1])
        pause = at - store.server_time()
        if pause > 0:
            time.sleep(pause)  # until the start it was told (Redis's clock)
        a = store.admit("m", ["m"], 1000, f"{sid}:1:slot", Waiter(sid, 1, 5), returning=at > 0)
        if a.admitted:
            started.append(a.now)
            store.release(HeldCall("m", ("m",), f"{sid}:1:slot", estimate=1000, delta=4000))
            del waiting[sid]
        else:
            waiting[sid] = a.until
    most = max(sum(1 for s in started if t <= s < t + 1.0) for t in started)
    assert most * 5000 <= 100_000 + 10_000 + 4_000 + 5000, f"{most} calls (x 5,000 tokens) started within a second"
    assert started[-1] - started[0] >= 1.7, "forty calls of 5,000 tokens take two seconds at 100 a ms"


def test_a_booked_call_is_not_held_back_by_calls_that_used_less_than_estimated(any_store: Store) -> None:
    any_store.set_limit("m", ModelLimit(tpm=600_000))
    first = [admit(any_store, ["m"], tokens=1000) for _ in range(10)]
    sid = uuid.uuid4().hex
    booked = admit(any_store, ["m"], tokens=1000, session=sid)
    for _ in first:
        any_store.release(HeldCall("m", ("m",), "s", estimate=1000, delta=-500))
    time.sleep(max(0.0, booked.until - booked.now) + 0.01)
    assert admit(any_store, ["m"], tokens=1000, session=sid).admitted


def test_a_full_concurrency_limit_queues_the_call_and_a_released_slot_wakes_it(any_store: Store) -> None:
    any_store.set_limit("m", ModelLimit(concurrency=2))
    holders = [uuid.uuid4().hex for _ in range(2)]
    assert all(admit(any_store, ["m"], session=s).admitted for s in holders)
    waiting = uuid.uuid4().hex
    refused = admit(any_store, ["m"], session=waiting)
    assert (refused.admitted, refused.reason) == (False, "concurrency")
    # nothing wakes it before the nearest slot lapses (a lease: AGENTS_LEASE_SECONDS)
    assert refused.until - refused.now == pytest.approx(any_store.settings.lease_seconds, abs=0.05)
    usage = any_store.limit_usages()[0]
    assert (usage.in_flight, usage.waiting) == (2, 1)
    released = any_store.release(HeldCall("m", ("m",), f"{holders[0]}:1:slot", 0))
    assert released.woken == (Waiter(waiting, 1, 5),)
    again = any_store.release(HeldCall("m", ("m",), f"{holders[0]}:1:slot", 0))
    assert again.woken == (), "a slot is given back once"
    assert admit(any_store, ["m"], session=waiting).admitted


def test_waiters_are_woken_highest_priority_first(any_store: Store) -> None:
    any_store.set_limit("m", ModelLimit(concurrency=1))
    holder = uuid.uuid4().hex
    assert admit(any_store, ["m"], session=holder).admitted
    low, high = uuid.uuid4().hex, uuid.uuid4().hex
    any_store.admit("m", ["m"], 0, "x", Waiter(low, 1, 2))
    any_store.admit("m", ["m"], 0, "y", Waiter(high, 1, 8))
    assert any_store.release(HeldCall("m", ("m",), f"{holder}:1:slot", 0)).woken == (Waiter(high, 1, 8),)


def test_the_slot_of_a_call_whose_worker_died_lapses_one_lease_later(any_store: Store) -> None:
    store = Store(any_store.client, replace(any_store.settings, lease_seconds=0.3))
    store.set_limit("m", ModelLimit(concurrency=1))
    assert admit(store, ["m"]).admitted  # its worker dies: nothing releases it
    refused = admit(store, ["m"])
    assert refused.reason == "concurrency"
    time.sleep(max(0.0, refused.until - refused.now) + 0.01)
    assert admit(store, ["m"]).admitted


def test_a_renewed_slot_does_not_lapse(any_store: Store) -> None:
    store = Store(any_store.client, replace(any_store.settings, lease_seconds=0.3))
    store.set_limit("m", ModelLimit(concurrency=1))
    sid = uuid.uuid4().hex
    assert admit(store, ["m"], session=sid).admitted
    slot = store.slot_key("m")
    for _ in range(4):  # 0.4 s: past its first lease
        time.sleep(0.1)
        assert store.scripts.run("slot_renew", [slot], [f"{sid}:1:slot", 300]) == 1
    assert admit(store, ["m"]).reason == "concurrency"


def test_a_paused_model_waits_until_the_pause_ends(any_store: Store) -> None:
    until = any_store.pause_model("m", 0.3)
    refused = admit(any_store, [], model="m")
    assert (refused.admitted, refused.reason, refused.key) == (False, "paused", "m")
    assert refused.until == pytest.approx(until, abs=1e-3)
    assert any_store.pause_model("m", 0.01) == pytest.approx(until, abs=1e-3), "a shorter pause keeps the longer"
    assert [p.model for p in any_store.pauses()] == ["m"]
    time.sleep(max(0.0, until - refused.now) + 0.01)
    assert admit(any_store, [], model="m").admitted
    assert any_store.pauses() == []
    assert admit(any_store, [], model="other").admitted


def test_only_the_binding_limit_is_booked(any_store: Store) -> None:
    any_store.set_limit("m", ModelLimit(rpm=60))  # the model: one a second
    any_store.set_limit("team", ModelLimit(rpm=6000))  # the team: a hundred a second
    assert admit(any_store, ["m", "team"]).admitted
    waiting = admit(any_store, ["m", "team"])
    assert (waiting.reason, waiting.key) == ("rate", "m")
    # the team's limit was not booked a second ahead: another model of the team starts now
    assert admit(any_store, ["team"], model="other").admitted


def test_a_limit_deleted_stops_holding_calls_and_hands_back_its_waiters(any_store: Store) -> None:
    any_store.set_limit("m", ModelLimit(concurrency=1, rpm=1))
    assert admit(any_store, ["m"]).admitted
    sid = uuid.uuid4().hex
    admit(any_store, ["m"], session=sid)
    assert any_store.delete_limit("m") == (True, [Waiter(sid, 1, 5)])
    assert any_store.delete_limit("m") == (False, [])
    assert admit(any_store, ["m"]).admitted
    assert any_store.limit_usages() == []


def test_how_many_calls_may_start_at_once_is_the_burst_setting(any_store: Store) -> None:
    store = Store(any_store.client, replace(any_store.settings, limits_burst=0.05))
    store.set_limit("m", ModelLimit(rpm=120))  # 500 ms apart; a burst of 50 ms holds one call
    first = admit(store, ["m"])
    assert first.admitted
    second = admit(store, ["m"])
    assert not second.admitted and second.until - first.now == pytest.approx(0.5, abs=0.01)


def test_a_pause_gives_up_the_starts_booked_before_it_and_moves_the_rates_past_it(any_store: Store) -> None:
    any_store.set_limit("m", ModelLimit(rpm=600))  # 100 ms apart
    held = uuid.uuid4().hex
    for i in range(10):
        assert admit(any_store, ["m"], session=held if i == 0 else "").admitted
    booked_sid = uuid.uuid4().hex
    booked = admit(any_store, ["m"], session=booked_sid)
    assert booked.reason == "rate" and any_store.client.exists(any_store.keys.limit_booking(booked_sid, 1))
    # the held call meets a 429 with Retry-After 2 s
    released = any_store.release(HeldCall("m", ("m",), f"{held}:1:slot", 0, pause=("m", 2.0)))
    assert released.paused_until is not None
    again = admit(any_store, ["m"], session=booked_sid)
    assert (again.reason, again.until) == ("paused", pytest.approx(released.paused_until, abs=1e-3))
    assert not any_store.client.exists(any_store.keys.limit_booking(booked_sid, 1)), "booked again after it"
    assert float(state(any_store, "m")["req_tat"]) / 1000 == pytest.approx(released.paused_until, abs=1e-3)


def test_a_limit_set_elsewhere_holds_in_this_process_once_its_copy_is_refresh_seconds_old(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker trusts its copy of the limits for AGENTS_LIMITS_REFRESH seconds (of its monotonic
    clock, moved on here by hand); with 0 it reads them at every call."""
    import celery_agents.store.admission as admission

    clock = [1000.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: clock[0])
    worker = Store(store.client, replace(store.settings, limits_refresh=1.0))
    elsewhere = Store(store.client, store.settings)
    agent = parse_agent({"slug": "a", "model": "fresh/model"})
    assert worker.fleet_limits().keys_for(agent) == ()
    elsewhere.set_limit("fresh/model", ModelLimit(rpm=60))
    clock[0] += 0.99
    assert worker.fleet_limits().keys_for(agent) == (), "its copy is trusted for a second"
    clock[0] += 0.02
    assert worker.fleet_limits().keys_for(agent) == ("fresh/model",)
    every_call = Store(store.client, replace(store.settings, limits_refresh=0.0))
    assert every_call.fleet_limits().keys_for(agent) == ("fresh/model",)
    elsewhere.delete_limit("fresh/model")
    assert every_call.fleet_limits().keys_for(agent) == (), "read again at the next call, at the same instant"
