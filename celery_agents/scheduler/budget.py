"""The budget check: whether a session may make its next model or tool call.

Pure: the spend and the limits of the session and of every session above it come in a list of
`BudgetScope`s, read by the step with the session; the answer is the error the session fails with,
or None. A limit is reached at or past it: the check before a call refuses it when the spend
already equals the limit, so a count (`modelCalls`, `toolCalls`) is never passed, and a token or
cost limit is passed at most by the one model call that crossed it. The budgets of the sessions
above a sub-agent, which its siblings spend at the same time, are checked by claims made on them
atomically (store/lua/claim_budget.lua, the same rule with the calls in flight counted).
"""

from __future__ import annotations

from collections.abc import Iterable

from celery_agents.errors import BudgetExceeded
from celery_agents.model import ErrorInfo, Spend
from celery_agents.model.budget import BudgetKind, BudgetScope


def over_budget(
    scopes: Iterable[BudgetScope], kinds: Iterable[BudgetKind], extra: Spend | None = None, *, own: str = ""
) -> ErrorInfo | None:
    """The `budget_exceeded` error if any limit of `kinds` in any scope is reached, counting
    `extra` (spent by this step and not yet committed) on top of each scope's spend; `own` is the
    id of the session checking (its own budget is named as such)."""
    more = extra or Spend()
    wanted = tuple(kinds)
    for scope in scopes:
        for kind in wanted:
            limit = scope.budget.limit(kind)
            if limit is None:
                continue
            spent = scope.spent.amount(kind) + more.amount(kind)
            if spent >= limit:
                return exceeded(scope.session_id, kind, spent, limit, own)
    return None


def exceeded(scope: str, kind: BudgetKind, spent: float, limit: float, own: str) -> ErrorInfo:
    """The `budget_exceeded` error of the limit `kind` of session `scope`'s budget, reached at
    `spent`, as session `own` (the one stopped) tells it."""
    whose = "the session's budget" if scope == own else f"the budget of session {scope} above it"
    amount = f"{spent:.6g}" if kind == "costUsd" else str(int(spent))
    cap = f"{limit:.6g}" if kind == "costUsd" else str(int(limit))
    message = (
        f"budget exceeded: {kind} spent {amount}, limit {cap} ({whose}, sub-agents included); "
        f"`agents session resume {scope} --grant {kind}=N` raises it"
    )
    return ErrorInfo(code=BudgetExceeded.code, message=message)
