"""Claims on a budget above (store/lua/claim_budget.lua) on a real Redis: steps of sibling
sub-agents running at once claim their calls on their parent's budget, so that together they never
pass a count and cross a token or cost limit with one call at most. Races run from threads released
at one barrier; a claim whose step died lapses one lease later, and one renewed stays."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

from celery_agents.model import UserQuery
from celery_agents.store import Store
from celery_agents.store.budget import BudgetWant, Claimed
from celery_agents.store.records import LeaseRef
from celery_agents.tools.resolve import parse_agent

MODEL = BudgetWant(model_calls=1, tokens=100, cost_usd=0.0)


def parent(store: Store, budget: dict[str, Any], spent: dict[str, float] | None = None) -> str:
    """A session with a budget, having spent `spent` (its header's spent_* fields)."""
    agent = parse_agent({"slug": "boss", "model": "fake/boss", "budget": budget})
    sid = store.create_session(agent, UserQuery(text="go")).session_id
    if spent:
        store.client.hset(store.keys.meta(sid), mapping={f"spent_{k}": v for k, v in spent.items()})
    return sid


def spend(store: Store, sid: str, field: str, amount: float) -> None:
    """What a sibling's commit adds to the budget above (commit_step.lua `add_spend`)."""
    store.client.hincrbyfloat(store.keys.meta(sid), f"spent_{field}", amount)


def race(store: Store, above: str, wants: list[BudgetWant]) -> list[Claimed]:
    """Each want claimed by its own step, all at once."""
    barrier = threading.Barrier(len(wants))
    out: list[Claimed | None] = [None] * len(wants)

    def claim(i: int) -> None:
        barrier.wait()
        out[i] = store.claim_budget([above], f"child{i} 1 w{i}", wants[i])

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(wants))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [c for c in out if c is not None]


def test_siblings_claiming_at_once_never_pass_a_count(store: Store) -> None:
    boss = parent(store, {"modelCalls": 5}, {"model_calls": 2})
    claimed = race(store, boss, [MODEL] * 8)
    assert sorted(c.outcome for c in claimed) == ["ok"] * 3 + ["wait"] * 5, "three calls were left; the rest wait"
    assert len(store.claims_held(boss)) == 3
    # the three answer: the waiting ones, back, are refused (the limit is reached), never admitted
    spend(store, boss, "model_calls", 3)
    store.client.delete(store.keys.claims(boss))
    again = store.claim_budget([boss], "child7 1 w7", MODEL)
    assert again.outcome == "refuse" and again.met is not None
    assert (again.met.kind, again.met.spent, again.met.limit) == ("modelCalls", 5, 5)


def test_tool_calls_beyond_the_room_left_are_refused_and_with_siblings_in_flight_they_wait(store: Store) -> None:
    boss = parent(store, {"toolCalls": 4}, {"tool_calls": 1})
    first = store.claim_budget([boss], "a 1 w", BudgetWant(tool_calls=2))
    assert (first.outcome, first.granted, first.met) == ("ok", 2, None)
    second = store.claim_budget([boss], "b 1 w", BudgetWant(tool_calls=2))
    assert second.outcome == "wait", "one is left beside the two in flight, and they may fail to start"
    store.release_claims([boss], "a 1 w")
    alone = store.claim_budget([boss], "b 1 w", BudgetWant(tool_calls=5))
    assert (alone.outcome, alone.granted) == ("ok", 3), "alone, as many as the limit leaves"
    assert alone.met is not None and (alone.met.kind, alone.met.spent, alone.met.limit) == ("toolCalls", 4, 4)


def test_bounded_model_calls_run_side_by_side_while_they_fit_and_one_alone_may_cross(store: Store) -> None:
    boss = parent(store, {"tokens": 1000}, {"tokens": 500})
    bounded = BudgetWant(model_calls=1, tokens=200, cost_usd=0.0)
    assert store.claim_budget([boss], "a 1 w", bounded).outcome == "ok"
    assert store.claim_budget([boss], "b 1 w", bounded).outcome == "ok", "500 + 200 + 200 fit in 1000"
    assert store.claim_budget([boss], "c 1 w", bounded).outcome == "wait", "a third could cross with the others"
    unbounded = BudgetWant(model_calls=1, tokens=None, cost_usd=None)
    assert store.claim_budget([boss], "d 1 w", unbounded).outcome == "wait", "no bound: it runs alone"
    store.release_claims([boss], "a 1 w")
    store.release_claims([boss], "b 1 w")
    assert store.claim_budget([boss], "d 1 w", unbounded).outcome == "ok", "alone, it may be the one that crosses"
    assert store.claim_budget([boss], "c 1 w", bounded).outcome == "wait"
    spend(store, boss, "tokens", 600)  # it crossed
    store.release_claims([boss], "d 1 w")
    crossed = store.claim_budget([boss], "c 1 w", bounded)
    assert crossed.outcome == "refuse" and crossed.met is not None and crossed.met.kind == "tokens"


def test_a_claim_of_tool_calls_holds_back_no_model_call_under_a_token_limit(store: Store) -> None:
    boss = parent(store, {"tokens": 1000, "toolCalls": 10})
    assert store.claim_budget([boss], "a 1 w", BudgetWant(tool_calls=3)).outcome == "ok"
    unbounded = BudgetWant(model_calls=1, tokens=None, cost_usd=None)
    assert store.claim_budget([boss], "b 1 w", unbounded).outcome == "ok"


def test_every_budget_above_is_claimed_and_the_strictest_decides(store: Store) -> None:
    top = parent(store, {"toolCalls": 10})
    mid = parent(store, {"toolCalls": 2})
    got = store.claim_budget([mid, top], "a 1 w", BudgetWant(tool_calls=5))
    assert (got.outcome, got.granted) == ("ok", 2) and got.met is not None and got.met.scope == 0
    assert list(store.claims_held(top)) == list(store.claims_held(mid)) == ["a 1 w"]
    store.release_claims([mid, top], "a 1 w")
    assert store.claims_held(top) == store.claims_held(mid) == {}


def test_a_claim_whose_step_died_lapses_one_lease_later_and_a_renewed_one_stays(store: Store) -> None:
    store = Store(store.client, replace(store.settings, lease_seconds=0.3))
    boss = parent(store, {"toolCalls": 2}, {"tool_calls": 1})
    one = BudgetWant(tool_calls=1)
    assert store.claim_budget([boss], "dead 1 w", one).outcome == "ok"
    assert store.claim_budget([boss], "b 1 w", one).outcome == "wait"
    time.sleep(0.4)  # the claim's own lifetime, the point of this test: nothing renews it
    assert store.claim_budget([boss], "b 1 w", one).outcome == "ok", "the dead step's claim lapsed"
    ref = LeaseRef(store.keys.claims(boss), "b 1 w", claim=True)
    for _ in range(3):
        time.sleep(0.15)
        assert store.renew_leases([ref]) == ["renewed"]
    assert store.claim_budget([boss], "c 1 w", one).outcome == "wait", "renewed, it holds"
    store.release_claims([boss], "b 1 w")
    assert store.renew_leases([ref]) == ["lost"]


def test_a_lapsed_claim_of_a_model_call_is_spent_at_its_bound_and_one_of_tool_calls_is_not(store: Store) -> None:
    store = Store(store.client, replace(store.settings, lease_seconds=0.3))
    boss = parent(store, {"modelCalls": 2, "tokens": 1000, "costUsd": 1.0, "toolCalls": 5}, {"model_calls": 1})
    dead = BudgetWant(model_calls=1, tokens=120, cost_usd=0.25)
    assert store.claim_budget([boss], "dead 1 w", dead).outcome == "ok"
    assert store.claim_budget([boss], "tools 1 w", BudgetWant(tool_calls=3)).outcome == "ok"
    time.sleep(0.4)  # both steps died: nothing renews their claims
    again = store.claim_budget([boss], "dead 1 w2", dead)
    spent = store.header(boss).spent
    assert (spent.model_calls, spent.tokens, spent.cost_usd, spent.tool_calls) == (2, 120, 0.25, 0), (
        "the dead step's model call was made, or may have been: it is spent; its tool calls are redone and counted then"
    )
    assert again.outcome == "refuse" and again.met is not None
    assert (again.met.kind, again.met.spent, again.met.limit) == ("modelCalls", 2, 2), "the redone call is refused"
    assert store.claims_held(boss) == {}


def test_a_lapsed_claim_of_an_unbounded_model_call_spends_what_its_limits_left(store: Store) -> None:
    """Without `max_tokens` what the lost call spent is unknown: under a token or cost limit it
    spent what was left of it (the limit is crossed by one call, never by two); a budget without
    such a limit counts the model call alone."""
    store = Store(store.client, replace(store.settings, lease_seconds=0.3))
    limited = parent(store, {"modelCalls": 5, "tokens": 1000, "costUsd": 0.3}, {"tokens": 400, "cost": 0.1})
    counted = parent(store, {"modelCalls": 5})
    unbounded = BudgetWant(model_calls=1, tokens=None, cost_usd=None)
    for boss in (limited, counted):
        assert store.claim_budget([boss], "dead 1 w", unbounded).outcome == "ok"
    time.sleep(0.4)
    refused = store.claim_budget([limited], "next 1 w", MODEL)
    assert refused.outcome == "refuse" and refused.met is not None and refused.met.kind == "tokens"
    spent = store.header(limited).spent
    assert (spent.model_calls, spent.tokens, spent.cost_usd) == (1, 1000, 0.3), "exactly at the limits"
    assert store.claim_budget([counted], "next 1 w", MODEL).outcome == "ok"
    spent = store.header(counted).spent
    assert (spent.model_calls, spent.tokens, spent.cost_usd) == (1, 0, 0.0)


def test_a_claim_of_an_earlier_attempt_of_the_same_step_is_spent_at_once(store: Store) -> None:
    """The step is redone by another worker before the dead attempt's claim has lapsed (its claim
    was renewed after its lease): the redo holds the step's lease, so the earlier attempt's claim
    is that of a dead (or frozen) worker, spent now rather than left to lapse unseen."""
    boss = parent(store, {"modelCalls": 2})
    assert store.claim_budget([boss], f"{boss} 3 w1", MODEL).outcome == "ok"
    assert store.claim_budget([boss], f"{boss} 3 w2", MODEL).outcome == "ok"
    assert list(store.claims_held(boss)) == [f"{boss} 3 w2"]
    assert store.header(boss).spent.model_calls == 1
    assert store.claim_budget([boss], f"{boss} 4 w1", MODEL).outcome == "wait", "another step's claim stands"


def test_settling_spends_a_model_calls_claim_once_at_its_bound_and_a_tool_claim_not_at_all(store: Store) -> None:
    boss = parent(store, {"modelCalls": 5, "tokens": 1000, "costUsd": 1.0})
    assert store.claim_budget([boss], "a 1 w", BudgetWant(model_calls=1, tokens=120, cost_usd=0.25)).outcome == "ok"
    assert store.claim_budget([boss], "b 1 w", BudgetWant(tool_calls=2)).outcome == "ok"
    assert store.settle_claims([boss], "a 1 w") == 1
    assert store.settle_claims([boss], "a 1 w") == 0, "settled once: the claim is gone"
    assert store.settle_claims([boss], "b 1 w") == 0, "a tool claim spends nothing: a redo counts its calls"
    spent = store.header(boss).spent
    assert (spent.model_calls, spent.tokens, spent.cost_usd, spent.tool_calls) == (1, 120, 0.25, 0)
    assert store.claims_held(boss) == {}
