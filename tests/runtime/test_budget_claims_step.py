"""`run_step` of a sub-agent's session below a budget, on a real Redis with a scripted model: its
model call is claimed on the budget above before it is made and the claim ends with the commit
that adds its spend; a claim that must wait for a sibling's call in flight puts the step back
without calling the model; a step that ends without a commit (a fleet limit put it back) leaves
no claim behind."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import redis

from celery_agents.model import LlmTurn, UserQuery
from celery_agents.model.admission import ModelLimit
from celery_agents.runtime import run_step
from celery_agents.scheduler import LlmRequest
from celery_agents.store import Store
from celery_agents.store.budget import BudgetWant
from celery_agents.store.counters import read_counters
from celery_agents.store.records import Waiter
from celery_agents.tools.resolve import parse_agent
from tests.scheduler.fakes import RecordingTools, ScriptedLlm, llm_turn

CHILD = parse_agent({"slug": "helper", "model": "fake/helper"})


def tree(store: Store, budget: dict[str, int] | None, child: Any = CHILD) -> tuple[str, str]:
    """A boss with `budget` and the child session one of its calls started (owed its first step)."""
    boss = parse_agent({"slug": "boss", "model": "fake/boss", "budget": budget})
    top = store.create_session(boss, UserQuery(text="go")).session_id
    store.start_child(top, "1:0", f"{top}-c", child, UserQuery(text="help"))
    return top, f"{top}-c"


def test_the_claim_is_made_before_the_model_call_and_ends_with_the_commit_that_spends(store: Store) -> None:
    top, child = tree(store, {"modelCalls": 3})
    seen: list[dict[str, str]] = []

    class Watching(ScriptedLlm):
        def complete(self, request: LlmRequest) -> LlmTurn:
            seen.append(store.claims_held(top))
            return super().complete(request)

    res = run_step(store, child, 1, llm=Watching(llm_turn(text="done")), tools=RecordingTools(), owner="w1")
    assert res.outcome == "committed"
    assert [list(c) for c in seen] == [[f"{child} 1 w1"]], "claimed while the call was made"
    assert store.claims_held(top) == {}, "the commit ended it"
    assert store.header(top).spent.model_calls == 1


def test_a_claim_that_must_wait_puts_the_step_back_without_calling_the_model(store: Store) -> None:
    top, child = tree(store, {"modelCalls": 2})
    store.client.hset(store.keys.meta(top), "spent_model_calls", 1)
    assert store.claim_budget([top], "sibling 1 w9", BudgetWant(model_calls=1)).outcome == "ok"
    llm = ScriptedLlm(llm_turn(text="done"))
    res = run_step(store, child, 1, llm=llm, tools=RecordingTools(), owner="w1")
    assert res.outcome == "throttled" and res.throttled is not None and llm.calls == 0
    assert (res.throttled.reason, res.throttled.key, res.throttled.requeue) == ("budget", top, True)
    assert 0.9 < res.throttled.countdown <= 1.0
    assert store.header(child).throttled_until is not None and store.lease_holder(child) is None
    assert list(store.claims_held(top)) == ["sibling 1 w9"], "the waiting step holds no claim"
    assert not any(k[0] == "model_calls_throttled" for k in read_counters(store.client, store.keys))
    # the sibling's call answered: back, the step finds the limit reached
    store.client.hset(store.keys.meta(top), "spent_model_calls", 2)
    store.release_claims([top], "sibling 1 w9")
    res = run_step(store, child, 1, llm=llm, tools=RecordingTools(), owner="w1")
    view = store.header(child)
    assert (res.outcome, llm.calls) == ("committed", 0)
    assert view.error is not None and f"modelCalls spent 2, limit 2 (the budget of session {top}" in view.error.message


def test_a_step_a_fleet_limit_puts_back_after_its_claim_leaves_no_claim(store: Store) -> None:
    store = Store(store.client, replace(store.settings, limits_refresh=0.0))
    store.set_limit(CHILD.model, ModelLimit(concurrency=1))
    assert store.admit(CHILD.model, [CHILD.model], 0, "other:1:slot", Waiter("other", 1, 5)).admitted
    top, child = tree(store, {"modelCalls": 3})
    res = run_step(store, child, 1, llm=ScriptedLlm(llm_turn(text="done")), tools=RecordingTools(), owner="w1")
    assert res.outcome == "throttled" and res.throttled is not None and res.throttled.reason == "concurrency"
    assert store.claims_held(top) == {}, "the claim went with the step"


class RoundTrips:
    """Counts what this process sends Redis: each command sent alone, each pipeline as one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        plain, batch = redis.Redis.execute_command, redis.client.Pipeline.execute
        counter = self

        def command(client: Any, *args: Any, **kw: Any) -> Any:
            if not isinstance(client, redis.client.Pipeline):
                counter.n += 1
            return plain(client, *args, **kw)

        def execute(pipe: Any, *args: Any, **kw: Any) -> Any:
            counter.n += 1
            return batch(pipe, *args, **kw)

        monkeypatch.setattr(redis.Redis, "execute_command", command)
        monkeypatch.setattr(redis.client.Pipeline, "execute", execute)


def test_a_step_below_a_budget_makes_one_round_trip_more_its_claim(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(store.client, replace(store.settings, limits_refresh=3600.0))
    store.scripts.load_all()
    store.fleet_limits()  # this process's copy of the fleet's limits: read once an hour here
    counted = RoundTrips(monkeypatch)
    trips: dict[bool, int] = {}
    budgets: list[dict[str, int]] = [{}, {"modelCalls": 3}]
    for budget in budgets:
        _, child = tree(store, budget or None)
        store.agent(store.header(child).agent_hash)  # the spec, read once per process
        before = counted.n
        res = run_step(store, child, 1, llm=ScriptedLlm(llm_turn(text="done")), tools=RecordingTools(), owner="w1")
        assert res.outcome == "committed"
        trips[bool(budget)] = counted.n - before
    assert trips[True] == trips[False] + 1, trips


def test_a_session_with_a_budget_claims_its_own_model_call_and_its_commit_ends_the_claim(store: Store) -> None:
    boss = parse_agent({"slug": "boss", "model": "fake/boss", "budget": {"modelCalls": 3}})
    top = store.create_session(boss, UserQuery(text="go")).session_id
    seen: list[dict[str, str]] = []

    class Watching(ScriptedLlm):
        def complete(self, request: LlmRequest) -> LlmTurn:
            seen.append(store.claims_held(top))
            return super().complete(request)

    res = run_step(store, top, 1, llm=Watching(llm_turn(text="done")), tools=RecordingTools(), owner="w1")
    assert res.outcome == "committed"
    assert [list(c) for c in seen] == [[f"{top} 1 w1"]], "a worker dying now leaves a claim that lapses into spend"
    assert store.claims_held(top) == {} and store.header(top).spent.model_calls == 1


@pytest.mark.parametrize("late", ["commits", "is refused"])
def test_a_frozen_step_whose_claim_lapsed_into_spend_adds_no_model_spend_again(store: Store, late: str) -> None:
    """The step's worker froze after claiming its model call; the claim lapsed, and a sibling's
    claim spent it at its bound on the budget above. The step wakes and commits (its lease held:
    nobody took it) or is refused (somebody did): the budget above counts the call once, at its
    bound; the step's own spend (it has no budget: no claim there) is what the call spent."""
    store = Store(store.client, replace(store.settings, lease_seconds=5.0))
    bounded = parse_agent(
        {
            "slug": "helper",
            "model": "fake/helper",
            "modelParams": {"max_tokens": 50},
            "pricing": {"inputPerMTokUsd": 1.0, "outputPerMTokUsd": 2.0},
        }
    )
    top, child = tree(store, {"modelCalls": 5, "tokens": 100_000}, bounded)

    class Freezing(ScriptedLlm):
        def complete(self, request: LlmRequest) -> LlmTurn:
            ((member, record),) = store.claims_held(top).items()
            store.client.hset(store.keys.claims(top), member, "0" + record[record.index(" ") :])  # lapsed
            assert store.claim_budget([top], "sibling 1 w9", BudgetWant(model_calls=1, tokens=10)).outcome == "ok"
            if late == "is refused":
                store.client.set(store.keys.lease(child), "w2")  # another worker took the step over
            return super().complete(request)

    res = run_step(store, child, 1, llm=Freezing(llm_turn(text="done")), tools=RecordingTools(), owner="w1")
    assert res.outcome == ("committed" if late == "commits" else "lost")
    top_spent, own = store.header(top).spent, store.header(child).spent
    assert top_spent.model_calls == 1 and top_spent.tokens > 50, "counted once above, at its bound"
    assert top_spent.cost_usd == pytest.approx(top_spent.tokens * 2.0 / 1e6), "and at its bound's cost"
    assert own.model_calls == 1, "the session itself, without a budget, counts what its call spent"
    assert list(store.claims_held(top)) == ["sibling 1 w9"]


@pytest.mark.parametrize("moved", ["cancelled", "taken over"])
def test_a_model_call_answered_to_a_step_that_then_lost_its_lease_is_spent(store: Store, moved: str) -> None:
    """The worker froze while the model answered; meanwhile the session was cancelled, or its
    lease lapsed and another worker took the step. Thawed, the step's commit is refused: the call
    the provider answered is spent all the same, at the usage it reported, and its claim ends."""
    import time

    store = Store(store.client, replace(store.settings, lease_seconds=0.6))
    boss = parse_agent(
        {
            "slug": "boss",
            "model": "fake/boss",
            "budget": {"modelCalls": 3},
            "modelParams": {"max_tokens": 50},
            "pricing": {"inputPerMTokUsd": 1.0, "outputPerMTokUsd": 2.0},
        }
    )
    top = store.create_session(boss, UserQuery(text="go")).session_id

    class Frozen(ScriptedLlm):
        def complete(self, request: LlmRequest) -> LlmTurn:
            if moved == "cancelled":
                store.cancel(top)
            store.client.set(store.keys.lease(top), "w2")
            time.sleep(0.5)  # past the lease's local deadline: the step asks Redis before acting
            return super().complete(request)

    res = run_step(store, top, 1, llm=Frozen(llm_turn(text="done")), tools=RecordingTools(), owner="w1")
    assert res.outcome == ("stale" if moved == "cancelled" else "lost"), "nothing of the step was saved"
    spent = store.header(top).spent
    assert (spent.model_calls, spent.tokens) == (1, 12), "the answer's usage (10 + 2), not the bound"
    assert spent.cost_usd == pytest.approx((10 * 1.0 + 2 * 2.0) / 1e6)
    assert store.claims_held(top) == {}


def test_a_fork_of_a_sub_agents_session_spends_under_the_budgets_above_its_origin(store: Store) -> None:
    top, child = tree(store, {"modelCalls": 5})
    fork = store.fork_session(store.origin_at(child)).header.session_id
    assert store.header(fork).bounded_by == [top] and store.header(fork).ancestors == [top]
    seen: list[list[str]] = []

    class Watching(ScriptedLlm):
        def complete(self, request: LlmRequest) -> LlmTurn:
            seen.append(list(store.claims_held(top)))
            return super().complete(request)

    res = run_step(store, fork, 1, llm=Watching(llm_turn(text="done")), tools=RecordingTools(), owner="w1")
    assert res.outcome == "committed" and seen == [[f"{fork} 1 w1"]], "claimed on the budget above"
    assert store.header(top).spent.model_calls == 1 and store.header(fork).spent.model_calls == 1
