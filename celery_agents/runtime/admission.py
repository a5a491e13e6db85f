"""A step's model call under the fleet's limits (`agents limits`) and its models' pauses.

`LimitedLlm` wraps the model port of one step. Before the call it asks whether any limit applies
(this process's copy of the limits, store/admission.py: nothing is sent for an agent under none)
and, when one does, admits the call in one round trip (`lua/admit.lua`). A call that may not start
now raises `Throttled`: the step writes nothing, gives its thread back and is put back for the time
the call may start (`run_step`, `tasks/step.py`). An admitted call holds a slot under each
concurrency limit, renewed while it lasts (runtime/lease.py) and given back with the step's commit,
its token estimate corrected by its usage (`held`, sent by `run_step`); a worker that dies mid-call
leaves a slot that lapses one lease later. A provider's 429 with `Retry-After` pauses the model for
the whole fleet until then, and the step goes back until then too.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator

from celery_agents.model import LlmTurn
from celery_agents.model.admission import estimate_tokens
from celery_agents.runtime.lease import LeaseKeeper
from celery_agents.scheduler.ports import LlmFailure, LlmPort, LlmRequest
from celery_agents.store import Store
from celery_agents.store.admission import Admission, HeldCall
from celery_agents.store.records import Waiter

#: a provider's Retry-After is honoured within these bounds (s): at once would ask again in a loop,
#: and a day-long one (a daily quota) is asked about again after ten minutes
PAUSE_BOUNDS = (0.1, 600.0)


class Throttled(Exception):
    """The step's model call may not start before `until` (seconds, Redis's clock; `now` is that
    clock when it was decided), because of the limit `key` (a KEY, or the paused model) and
    `reason` (rate, concurrency, paused). `requeue`: the step is published again for `until`;
    otherwise (waiting for a slot) a released slot wakes it, the sweeper at `until` if none does."""

    def __init__(self, admission: Admission) -> None:
        super().__init__(f"model call throttled by {admission.key} ({admission.reason}) until {admission.until}")
        self.until = admission.until
        self.now = admission.now
        self.key = admission.key
        self.reason = admission.reason or "rate"

    @property
    def requeue(self) -> bool:
        return self.reason != "concurrency"

    @property
    def countdown(self) -> float:
        """Seconds from its decision until the call may start."""
        return max(0.0, self.until - self.now)


class LimitedLlm:
    """The model port of one step (session `waiter.session_id` at `waiter.version`) under the
    fleet's limits; `held` is the admitted call to release with the step's commit, `woken` the
    steps a release here woke."""

    def __init__(self, store: Store, inner: LlmPort, waiter: Waiter, returning: bool = True) -> None:
        """`returning`: the step was put back before (it may hold a booked start)."""
        self.store, self.inner, self.waiter, self.returning = store, inner, waiter, returning
        self.held: HeldCall | None = None
        self.woken: list[Waiter] = []

    def complete(self, request: LlmRequest) -> LlmTurn:
        agent = request.agent
        fleet = self.store.fleet_limits()
        keys = fleet.keys_for(agent)
        if not keys and not fleet.paused_now(agent.model):
            return self._call(request, None)
        estimate = (
            estimate_tokens(request.messages, request.tools, agent.model_params) if fleet.wants_tokens(keys) else 0
        )
        slot = f"{self.waiter.session_id}:{self.waiter.version}:{secrets.token_hex(4)}"
        admission = self.store.admit(agent.model, keys, estimate, slot, self.waiter, returning=self.returning)
        if not admission.admitted:
            raise Throttled(admission)
        slotted = tuple(k for k in keys if fleet.limits[k].concurrency is not None)
        self.held = HeldCall(agent.model, keys, slot, estimate, slotted, needs_release=admission.release)
        return self._call(request, self.held)

    def _call(self, request: LlmRequest, held: HeldCall | None) -> LlmTurn:
        try:
            with self._slots(held):
                turn = self.inner.complete(request)
        except LlmFailure as exc:
            if exc.code == "rate_limited" and exc.retry_after is not None:
                raise self._paused(exc.model or request.agent.model, exc.retry_after) from exc
            raise
        if held is not None:
            used = turn.usage.total_tokens or turn.usage.prompt_tokens + turn.usage.completion_tokens
            held.delta = used - held.estimate if used else 0
        return turn

    def _paused(self, model: str, retry_after: float) -> Throttled:
        """The provider refused the call for `retry_after` s: `model` is paused for the fleet, the
        call's slot given back with its whole estimate (the provider counted nothing)."""
        seconds = min(max(retry_after, PAUSE_BOUNDS[0]), PAUSE_BOUNDS[1])
        held = self.held or HeldCall(model=model, keys=(), slot="", estimate=0)
        held.delta, held.pause, held.needs_release = -held.estimate, (model, seconds), True
        self.held = None
        released = self.store.release(held)
        self.woken += released.woken
        until = released.paused_until or 0.0
        return Throttled(Admission(False, now=released.now, until=until, reason="paused", key=model))

    def release_now(self) -> None:
        """Give back the admitted call's slot now (the step ends without a commit to send it with)."""
        if self.held is not None:
            held, self.held = self.held, None
            if held.needs_release:
                self.woken += self.store.release(held).woken

    def to_release(self) -> HeldCall | None:
        """The admitted call for the commit to end, if there is anything to end; taken from here."""
        held, self.held = self.held, None
        return held if held is not None and held.needs_release else None

    @contextlib.contextmanager
    def _slots(self, held: HeldCall | None) -> Iterator[None]:
        """Renew the call's slots while it lasts (a call may outlast a lease)."""
        with contextlib.ExitStack() as stack:
            if held is not None:
                for key in held.slotted:
                    stack.enter_context(LeaseKeeper(self.store, self.store.slot_key(key), held.slot, slot=True))
            yield
