"""Claims on the budgets of the sessions above a sub-agent's session (`lua/claim_budget.lua`).

Sibling sub-agents run at once: each step claims, on every budgeted session above it, the model
call or the tool calls it is about to start, in one round trip that also checks them against the
spend committed and the other steps' claims in flight. A claim lives in the claims hash of the
session above (`Keys.claims`), under the step's member, until the step's commit deletes it
(commit_step.lua, in the write that adds the spend it was for) or the step ends without one. It
is renewed with the step's lease, and lapses one lease after its step died.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from celery_agents.model.budget import BUDGET_KINDS, BudgetKind
from celery_agents.store.core import StoreCore


@dataclass(frozen=True)
class BudgetWant:
    """What a step is about to start: a model call (with the most tokens and dollars it may spend;
    None: no bound) or tool calls."""

    model_calls: int = 0
    tool_calls: int = 0
    tokens: int | None = 0
    cost_usd: float | None = 0.0


@dataclass(frozen=True)
class HeldClaim:
    """A step's claims: its member on the claims of each session `above` with a budget."""

    above: tuple[str, ...]
    member: str


@dataclass(frozen=True)
class BudgetLimit:
    """The limit a claim met: the scope (its index among the sessions above), kind, spend, limit."""

    scope: int
    kind: BudgetKind
    spent: float
    limit: float


@dataclass(frozen=True)
class Claimed:
    """What claim_budget.lua said: `ok` (claimed; `granted` tool calls may start, fewer than asked
    when `met` stopped the rest), `wait` (calls in flight may leave no room: `met` has no amounts)
    or `refuse` (the limit `met` is reached)."""

    outcome: Literal["ok", "wait", "refuse"]
    granted: int = 0
    met: BudgetLimit | None = None
    #: Redis's clock when it decided to wait (seconds)
    now: float = 0.0


def _limit(reply: list[Any], at: int) -> BudgetLimit:
    kind = str(reply[at + 1])
    if kind not in BUDGET_KINDS:
        raise ValueError(f"claim_budget.lua named no budget kind: {kind!r}")
    spent = float(reply[at + 2]) if len(reply) > at + 2 else 0.0
    limit = float(reply[at + 3]) if len(reply) > at + 3 else 0.0
    return BudgetLimit(int(reply[at]) - 1, kind, spent, limit)


def _bound(value: float | None) -> str:
    return "-1" if value is None else repr(value)


class BudgetStore(StoreCore):
    """Claims on the budgets above a session: made, renewed (store/steps.py `renew_leases`),
    released."""

    def claim_budget(self, above: Sequence[str], member: str, want: BudgetWant) -> Claimed:
        """Claim `want` under `member` on the budgets of the sessions `above` (parent first)."""
        keys = [k for sid in above for k in (self.keys.meta(sid), self.keys.claims(sid))]
        lease_ms = int(self.settings.lease_seconds * 1000)
        args = [member, lease_ms, want.model_calls, want.tool_calls, _bound(want.tokens), _bound(want.cost_usd)]
        reply = self.through_outage(lambda: self.scripts.run("claim_budget", keys, args))
        outcome = str(reply[0])
        if outcome == "ok":
            return Claimed("ok", int(reply[1]), _limit(reply, 2) if len(reply) > 2 else None)
        if outcome == "wait":
            return Claimed("wait", met=_limit(reply[:4], 2), now=int(reply[1]) / 1000)
        if outcome == "refuse":
            return Claimed("refuse", met=_limit(reply, 1))
        raise ValueError(f"claim_budget.lua answered {outcome!r}")

    def release_claims(self, above: Sequence[str], member: str, pipe: Any = None) -> None:
        """Delete the claims of `member` on the sessions `above` (on `pipe`, when given)."""
        if pipe is not None:
            for sid in above:
                pipe.hdel(self.keys.claims(sid), member)
            return
        target = self.client.pipeline(transaction=False)
        for sid in above:
            target.hdel(self.keys.claims(sid), member)
        self.through_outage(target.execute)

    def settle_claims(self, above: Sequence[str], member: str) -> int:
        """End the claims of `member` on the sessions `above` whose step's model answered and
        which ends without sending its commit: each model call claim still there is spent at its bound
        (`lua/settle_claim.lua`). Returns how many were."""
        keys = [k for sid in above for k in (self.keys.meta(sid), self.keys.claims(sid))]
        return int(self.through_outage(lambda: self.scripts.run("settle_claim", keys, [member])))

    def claims_held(self, session_id: str) -> dict[str, str]:
        """The claims in flight on the budget of `session_id` (member -> record)."""
        return cast("dict[str, str]", self.client.hgetall(self.keys.claims(session_id)))
