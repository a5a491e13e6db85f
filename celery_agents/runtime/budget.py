"""A step's claims on its session's budget and those of the sessions above it (the scheduler's `BudgetPort`).

Sibling sub-agents run at once, so the spend an ancestor's budget shows when a step reads it says
nothing of the calls its siblings are making. Each model call and each batch of tool calls of a
session with a budget, or below one, is claimed on that budget first (`Store.claim_budget`, one round trip, in
place of reading those budgets): a count is never passed, and a token or cost limit is crossed by
at most the one call in flight when it is crossed. What a model call may spend is bounded from
its request: its prompt's UTF-8 bytes (no tokenizer makes more tokens than bytes) plus a few
tokens of framing per message, plus the answer's `max_tokens` (or `max_completion_tokens`) of
`modelParams`, priced at the agent file's `pricing` or litellm's; without `max_tokens` the call
has no bound and runs only when no other model call under that budget is in flight. A claim that
must wait puts the step back, like a fleet limit (`Throttled`, reason "budget"), to look again in
`BUDGET_WAIT_S`. The claim lives while the step does (renewed with its lease) and goes with its
commit, or when it ends without one. A worker that dies after claiming a model call leaves its
claim to lapse: the call was made, or may have been, and its answer is lost, so the next claim on
that budget spends it there (the model call, and the tokens and cost of its bound) — the step
redone asks the model again, and both calls count.
"""

from __future__ import annotations

import contextlib
import json
import logging

from celery_agents.model import ErrorInfo, SessionHeader
from celery_agents.model.budget import Pricing
from celery_agents.runtime.admission import Throttled
from celery_agents.runtime.lease import LeaseKeeper
from celery_agents.scheduler.budget import exceeded
from celery_agents.scheduler.ports import BudgetClaim, LlmRequest
from celery_agents.store import Store
from celery_agents.store.admission import Admission
from celery_agents.store.budget import BudgetWant, Claimed, HeldClaim

log = logging.getLogger("celery_agents.step")

#: how soon a step that waits for its siblings' calls in flight looks again (s)
BUDGET_WAIT_S = 1.0
#: tokens a request's framing may add to each message beyond its text (role, separators)
FRAMING_TOKENS = 8


def token_bound(request: LlmRequest) -> int | None:
    """The most tokens the call may spend, prompt and answer; None without an answer bound."""
    params = request.agent.model_params
    answer = params.get("max_completion_tokens") or params.get("max_tokens")
    if not isinstance(answer, int) or isinstance(answer, bool) or answer <= 0:
        return None
    prompt = len(json.dumps([request.messages, request.tools], ensure_ascii=False).encode())
    return prompt + FRAMING_TOKENS * len(request.messages) + answer


def cost_bound(request: LlmRequest, tokens: int | None) -> float | None:
    """The most the call may cost (USD) when it spends at most `tokens`: at the agent file's
    `pricing`, else at the dearest of its models by litellm's price list."""
    if tokens is None:
        return None
    agent = request.agent
    pricing = agent.pricing
    if pricing is None:
        from celery_agents.llm.prices import price_per_token  # litellm: a step calling a model has it

        prices = [price_per_token(m) for m in (agent.model, *(f.model for f in agent.fallback_models))]
        pricing = Pricing(
            input_per_mtok_usd=max(p[0] for p in prices) * 1e6, output_per_mtok_usd=max(p[1] for p in prices) * 1e6
        )
    return tokens * max(pricing.input_per_mtok_usd, pricing.output_per_mtok_usd) / 1e6


class BudgetClaims:
    """The claims of one step (session `header` at its version, run by `owner`) on the budgets
    above its session: `NoBudgetAbove` for a session with none; closed when the step ends."""

    def __init__(self, store: Store, header: SessionHeader, owner: str) -> None:
        self.store = store
        self.own = header.session_id
        #: the budgets claimed: the session's own, then those above it
        self.above = (self.own, *header.bounded_by) if header.budget is not None else tuple(header.bounded_by)
        self.member = f"{header.session_id} {header.version} {owner}"
        self.held: HeldClaim | None = None
        #: the claim is a model call's, and the model answered it
        self._model = self._answered = False
        self._renewals = contextlib.ExitStack()

    def claim_model(self, request: LlmRequest) -> BudgetClaim:
        if not self.above:
            return BudgetClaim(1)
        tokens = token_bound(request)
        claim = self._claim(BudgetWant(model_calls=1, tokens=tokens, cost_usd=cost_bound(request, tokens)), 1)
        self._model = claim.granted > 0
        return claim

    def answered(self) -> None:
        """The model answered the claimed call: from now on it is spent, committed or not."""
        self._answered = True

    def claim_tools(self, count: int) -> BudgetClaim:
        if not self.above or count <= 0:
            return BudgetClaim(count)
        return self._claim(BudgetWant(tool_calls=count), count)

    def _claim(self, want: BudgetWant, asked: int) -> BudgetClaim:
        got = self.store.claim_budget(self.above, self.member, want)
        met = got.met
        if got.outcome == "wait" and met is not None:
            until = got.now + BUDGET_WAIT_S
            raise Throttled(Admission(False, now=got.now, until=until, reason="budget", key=self.above[met.scope]))
        if got.outcome == "refuse":
            return BudgetClaim(0, self._refusal(got))
        self._hold()
        return BudgetClaim(got.granted, self._refusal(got) if got.granted < asked else None)

    def _refusal(self, got: Claimed) -> ErrorInfo:
        met = got.met
        assert met is not None, "a refusal names its limit"
        return exceeded(self.above[met.scope], met.kind, met.spent, met.limit, self.own)

    def _hold(self) -> None:
        """Keep the claims alive (renewed with the step's lease) until the step ends."""
        if self.held is None:
            self.held = HeldClaim(self.above, self.member)
            for sid in self.above:
                keeper = LeaseKeeper(self.store, self.store.keys.claims(sid), self.member, claim=True)
                self._renewals.enter_context(keeper)

    def to_release(self) -> HeldClaim | None:
        """The claims for the commit to delete (in its round trip), if the step holds any: taken
        from here."""
        held, self.held = self.held, None
        return held

    def close(self) -> None:
        """The step ended: stop renewing its claims and end those its commit did not. A model
        call the model answered is spent at its bound (the step ended without sending its commit
        after the answer; `Store.settle_claims`); other claims are deleted. If Redis does not
        answer, they lapse one lease later, and a lapsed model call claim is spent then."""
        self._renewals.close()
        held, self.held = self.held, None
        if held is not None:
            store = self.store.at_once()
            with contextlib.suppress(Exception):
                if self._model and self._answered:
                    store.settle_claims(held.above, held.member)
                else:
                    store.release_claims(held.above, held.member)
