"""The budget check alone: a limit is reached at or past it, in any scope (the session's own or
one above it), counting what the step has started and not yet committed."""

from __future__ import annotations

from celery_agents.model import Budget, Spend
from celery_agents.model.budget import MODEL_KINDS, TOOL_KINDS, BudgetScope, parse_grant
from celery_agents.scheduler.budget import over_budget


def scope(sid: str, budget: Budget, spent: Spend) -> BudgetScope:
    return BudgetScope(sid, budget, spent)


def test_a_limit_is_reached_at_it_not_before() -> None:
    mine = [scope("s", Budget(model_calls=2), Spend(model_calls=1))]
    assert over_budget(mine, MODEL_KINDS, own="s") is None
    at = [scope("s", Budget(model_calls=2), Spend(model_calls=2))]
    err = over_budget(at, MODEL_KINDS, own="s")
    assert err is not None and err.code == "budget_exceeded"
    assert "modelCalls spent 2, limit 2 (the session's budget" in err.message
    assert "agents session resume s --grant modelCalls=N" in err.message


def test_only_the_kinds_asked_about_are_checked() -> None:
    spent = [scope("s", Budget(tool_calls=1, cost_usd=0.5), Spend(tool_calls=1, cost_usd=0.25))]
    assert over_budget(spent, MODEL_KINDS, own="s") is None, "a tool limit does not stop a model call"
    assert over_budget(spent, TOOL_KINDS, own="s") is not None


def test_the_step_s_own_uncommitted_calls_count_and_an_ancestor_s_limit_binds() -> None:
    scopes = [scope("child", Budget(tool_calls=10), Spend(tool_calls=1)), scope("top", Budget(tool_calls=3), Spend())]
    assert over_budget(scopes, TOOL_KINDS, Spend(tool_calls=2), own="child") is None
    err = over_budget(scopes, TOOL_KINDS, Spend(tool_calls=3), own="child")
    assert err is not None and "the budget of session top above it" in err.message


def test_a_cost_limit_is_named_in_dollars() -> None:
    err = over_budget([scope("s", Budget(cost_usd=0.01), Spend(cost_usd=0.0125))], MODEL_KINDS, own="s")
    assert err is not None and "costUsd spent 0.0125, limit 0.01" in err.message


def test_a_grant_names_kinds_and_amounts() -> None:
    assert parse_grant("tokens=500, costUsd=0.5") == Budget(tokens=500, cost_usd=0.5)
    for bad in ("", "steps=3", "tokens", "tokens=-1", "modelCalls=x"):
        try:
            parse_grant(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} was accepted")
