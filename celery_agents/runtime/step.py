"""Running one step: take the lease, decide with the scheduler, commit atomically.

Used the same way by the Celery `step` task and by the CLI's inline mode. What to publish after
the commit (tool tasks, the next step) is returned to the caller; so is a step whose model call a
fleet limit made wait (outcome "throttled"), put back for the time it may start
(runtime/admission.py). What the step counts (its model
calls and tokens, its inline tool calls) goes to the fleet's counters with the script that ends
it, its outcome too (store/counters.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

from celery_agents import observe
from celery_agents.errors import RedisUnavailable, UntrustedSpec
from celery_agents.model import ErrorInfo, ScriptOutcome, SessionHeader, State, StepOutcome, TrackedCall, UserQuery
from celery_agents.model.admission import DEFAULT_PRIORITY
from celery_agents.runtime.admission import LimitedLlm, Throttled
from celery_agents.runtime.budget import BudgetClaims
from celery_agents.runtime.faults import checkpoint
from celery_agents.runtime.lease import LeaseKeeper
from celery_agents.runtime.live import DeltaHook, SessionLive, interrupts_heard
from celery_agents.runtime.ports import (
    Fence,
    FencedLlm,
    JournaledTools,
    RedisClock,
    SecureIds,
    outcome_from_json,
)
from celery_agents.scheduler import Ports, Snapshot, Transition, advance
from celery_agents.scheduler.ports import Clock, Ids, LlmPort, ToolPort
from celery_agents.store import LeaseLost, Store
from celery_agents.store.admission import HeldCall
from celery_agents.store.budget import HeldClaim
from celery_agents.store.commit import commit_record
from celery_agents.store.counters import Counts
from celery_agents.store.records import Begun, Committed, Loaded, Waiter
from celery_agents.store.signing import trusted_grants

log = logging.getLogger("celery_agents.step")

#: Redis could not be reached (for as long as the store waits for it)
#: Redis out of reach (the store's client translates redis-py's errors into this one)
_UNREACHABLE = RedisUnavailable

#: a script's refusal as the step outcome it means
_STEP_OUTCOMES: dict[ScriptOutcome, StepOutcome] = {
    "stale": "stale",
    "busy": "busy",
    "ended": "ended",
    "missing": "missing",
    "lost_lease": "lost",
}


@dataclass
class StepResult:
    """What a step did."""

    outcome: StepOutcome
    version: int = 0
    state: State | None = None
    dispatch: list[TrackedCall] = field(default_factory=list)
    #: another step is owed at `version` (auto drive)
    owed: bool = False
    #: the session is a child: its parent's id (a child that ends settles its parent's call)
    parent: str | None = None
    #: the session's priority: the next step is published with it
    priority: int = DEFAULT_PRIORITY
    #: a fleet limit made the model call wait (outcome "throttled"): until when, and why
    throttled: Throttled | None = None
    #: steps of other sessions a slot this step gave back woke (to publish)
    woken: list[Waiter] = field(default_factory=list)


def run_step(
    store: Store,
    session_id: str,
    version: int,
    *,
    llm: LlmPort,
    tools: ToolPort,
    owner: str,
    request: str = "",
    clock: Clock | None = None,
    ids: Ids | None = None,
    pause_on_interrupt: bool = False,
    on_delta: DeltaHook | None = None,
) -> StepResult:
    """One step of `session_id` at `version` under `owner`. `pause_on_interrupt` (a step run by the
    command that drives the session, which nothing else drives): Ctrl-C pauses the session.
    `on_delta` hears the answer as it streams (an inline step's caller)."""
    # Interrupts are heard from before the session is read: a message queued after that read and
    # sent with `--interrupt` cancels this step's model call.
    with interrupts_heard(store, session_id) as watch:
        asked_at = time.monotonic()  # the lease counts from before it was asked for
        begun = store.begin_step(session_id, version, owner, request)
        loaded = begun.loaded
        if loaded is None:
            return _refused(begun, version)
        header, keys = loaded.header, store.keys
        lease = LeaseKeeper(
            store,
            keys.lease(session_id),
            owner,
            header=keys.meta(session_id),
            version=header.version,
            taken_at=asked_at,
        )
        live = SessionLive(
            store,
            session_id,
            header.version,
            watch=watch,
            read=len(loaded.inbox),
            hook=on_delta,
            watched=loaded.watched or on_delta is not None,
        )
        waiter = Waiter(session_id, header.version, header.priority)
        parts = _Parts(
            fence=Fence(owner, header.version, lease.holds, lambda: lease.retaken),
            lease=lease,
            live=live,
            limited=LimitedLlm(store, llm, waiter, returning=header.throttled_until is not None),
            claims=BudgetClaims(store, header, owner),
        )
        with contextlib.closing(parts.claims):
            return _run_loaded(store, loaded, owner, request, parts, tools, clock, ids, pause_on_interrupt)


@dataclass
class _Parts:
    """What a step holds while it runs: its lease and fence, its live output, its model port
    under fleet limits, its claims on the budgets above it, and what it counted."""

    fence: Fence
    lease: LeaseKeeper
    live: SessionLive
    limited: LimitedLlm
    claims: BudgetClaims
    tally: observe.Tally = field(default_factory=observe.Tally)


def _run_loaded(
    store: Store,
    loaded: Loaded,
    owner: str,
    request: str,
    parts: _Parts,
    tools: ToolPort,
    clock: Clock | None,
    ids: Ids | None,
    pause_on_interrupt: bool,
) -> StepResult:
    """Decide the step under its lease, then commit it (or end it): each way out of a step."""
    header = loaded.header
    session_id, version = header.session_id, header.version
    limited, tally = parts.limited, parts.tally
    try:
        try:
            with parts.lease, observe.tallying(tally):
                t = _decide(store, loaded, parts, tools, clock, ids)
            # A step that lost its lease commits nothing: commit_step refuses it (the lease, the
            # version or the session moved). One whose model answered sends its commit anyway,
            # for that refusal: it adds the call's spend (its usage, to the session and every
            # one above) and ends its budget claims, as no other way out of the step does.
            if t.commit and not t.spend.model_calls:
                parts.fence.check(session_id)
        except BaseException:
            _release_quietly(limited)
            raise
    except Throttled as exc:
        # A wait for the budget above is not a model call's throttle (its counter is per KEY).
        counted: Counts = {} if exc.reason == "budget" else {("model_calls_throttled", exc.key): 1}
        store.throttle_step(session_id, owner, request, exc.until, exc.key, exc.reason, {**tally.counts, **counted})
        log.info("step of session %s at version %s put back until %.3f: %s", session_id, version, exc.until, exc)
        return StepResult(
            outcome="throttled", version=version, priority=header.priority, throttled=exc, woken=limited.woken
        )
    except LeaseLost as exc:
        # Frozen or cut off long enough for another worker to take over: that worker owns the
        # step now; this one starts nothing more and leaves the session alone.
        log.warning("%s: it starts and writes nothing more", exc)
        store.count({**tally.counts, ("steps", "lost"): 1})
        return StepResult(outcome="lost", version=version)
    except KeyboardInterrupt:
        # Ctrl-C of an inline step: let the session go now, not when the lease lapses (30 s). Paused,
        # it is owed nothing until `resume` or `step`; the pause comes first, while the lease still
        # holds, or a worker's sweeper could take the step up in between. Otherwise the step stays
        # owed, for the next `resume` or a worker.
        if pause_on_interrupt:
            with contextlib.suppress(Exception):
                store.set_drive(session_id, "manual")
        _safe_end(store, session_id, owner, request, "interrupted", keep_owed=True, counts=tally.counts)
        checkpoint("step_interrupted", store, session_id)
        raise
    except _UNREACHABLE as exc:
        _give_up(store, session_id, version, owner, request, exc, tally.counts)
        raise
    except Exception as exc:
        return _failed(store, header, owner, exc, tally.counts)
    try:
        done = _settle(store, header, owner, request, t, parts)
    except _UNREACHABLE as exc:
        _give_up(store, session_id, version, owner, request, exc, tally.counts)
        raise
    finally:
        _release_quietly(limited)
    done.priority, done.woken = header.priority, limited.woken
    return done


def _release_quietly(limited: LimitedLlm) -> None:
    """Give back a slot the step still holds (it ends without the commit that would have): if
    Redis does not answer, the slot lapses one lease later."""
    with contextlib.suppress(Exception):
        limited.release_now()


def _give_up(
    store: Store, session_id: str, version: int, owner: str, request: str, exc: Exception, counts: Counts
) -> None:
    """Redis stayed away longer than this store waits for it (infrastructure, not the session):
    nothing of the step was written (each of its writes is one script); it stays owed, and is taken
    up again once its lease lapses, or at once if Redis answers the end of the step now."""
    log.error("step of session %s at version %s gave up, nothing of it written: %s", session_id, version, exc)
    _safe_end(store, session_id, owner, request, "error", keep_owed=True, counts=counts)


def _decide(
    store: Store,
    loaded: Loaded,
    parts: _Parts,
    tools: ToolPort,
    clock: Clock | None,
    ids: Ids | None,
) -> Transition:
    """The step's transition, decided under the session's lease with fenced, journaled ports."""
    header = loaded.header
    if header.grants:  # with AGENTS_SPEC_KEY, a grant counts only if a holder of the key sealed it
        header = header.model_copy(
            update={"grants": trusted_grants(store.settings.spec_key, header.session_id, header.grants)}
        )
    checkpoint("step_begun", store, header.session_id)
    agent = store.agent(header.agent_hash, header.session_id)
    fence = parts.fence
    ports = Ports(
        llm=FencedLlm(store, parts.limited, fence, parts.live, answered=parts.claims.answered),
        tools=JournaledTools(store, loaded.journal, tools, fence),
        clock=clock or RedisClock(loaded.redis_now),
        ids=ids or SecureIds(),
        budget=parts.claims,
    )
    inbox = _inbox_of_step(store, header.session_id, loaded, fence)
    # A rerun's recorded outcomes: read only for a rerun (a flag of its header), one HGETALL.
    recorded = {d: outcome_from_json(o) for d, o in store.replayed(header.session_id).items()} if header.replays else {}
    snap = Snapshot(
        header=header,
        agent=agent,
        turns=loaded.turns,
        calls=loaded.calls,
        inbox=inbox,
        budgets=store.budget_scopes(header),
        recorded=recorded,
    )
    t = advance(snap, ports)
    t.calls = observe.stamp_deferred(t.calls)
    return t


def _failed(store: Store, header: SessionHeader, owner: str, exc: Exception, counts: Counts) -> StepResult:
    """The step raised: the session fails with the error recorded (resumable once it is fixed)."""
    session_id, version = header.session_id, header.version
    if isinstance(exc, UntrustedSpec):
        # Not the session's fault to retry away: its spec was not stored by a holder of the key.
        log.warning("step of session %s refused: %s", session_id, exc.message)
        error = ErrorInfo(code=exc.code, message=exc.message)
    else:
        log.exception("step of session %s at version %s failed", session_id, version, exc_info=exc)
        error = ErrorInfo(code="internal_error", message=f"{type(exc).__name__}: {exc}")
    store.fail_step(session_id, version, error, owner, counts)
    return StepResult(outcome="failed", version=version + 1, state=State.FAILED, parent=header.parent)


def _settle(
    store: Store,
    header: SessionHeader,
    owner: str,
    request: str,
    t: Transition,
    parts: _Parts,
) -> StepResult:
    """Commit the transition (or end the step when there is nothing to write); the model call
    admitted under fleet limits and the claims on the budgets above end with the commit, in its
    round trip."""
    session_id, version = header.session_id, header.version
    counts = parts.tally.counts
    if not t.commit:
        outcome: StepOutcome = "waiting" if t.kind == "wait" else "noop"
        store.end_step(session_id, owner, request, t.kind, outcome=outcome, counts=counts)
        return StepResult(outcome=outcome, version=version, state=t.state)
    limited = parts.limited
    done = commit_transition(
        store,
        header,
        owner,
        t,
        request=request,
        counts=counts,
        deltas=tuple(parts.live.ids),
        release=limited.to_release(),
        claim=parts.claims.to_release(),
    )
    if done.released is not None:
        limited.woken += done.released.woken
    if done.outcome != "ok":
        log.info("step of session %s at version %s not committed: %s", session_id, version, done.outcome)
        return StepResult(outcome=_STEP_OUTCOMES.get(done.outcome, "lost"), version=version)
    return StepResult(
        outcome="committed",
        version=done.version,
        state=t.state,
        dispatch=t.dispatch,
        owed=done.owed,
        parent=header.parent,
    )


def _inbox_of_step(store: Store, session_id: str, loaded: Loaded, fence: Fence) -> list[UserQuery]:
    """The queued messages this step delivers: the ones it read, unless an earlier copy of the step
    journaled fewer (its inline tools may have run on the strength of those; the later ones wait
    their turn)."""
    if not loaded.inbox:
        return []
    field = f"inbox:{loaded.header.version}"
    taken = loaded.journal.get(field)
    if taken is None:
        taken = store.journal_put(session_id, field, str(len(loaded.inbox)), fence.owner, fence.version)
    return loaded.inbox[: int(taken)]


def commit_transition(
    store: Store,
    header: SessionHeader,
    owner: str,
    t: Transition,
    *,
    request: str = "",
    calls: list[TrackedCall] | None = None,
    now: float | None = None,
    counts: Counts | None = None,
    deltas: tuple[str, ...] = (),
    release: HeldCall | None = None,
    claim: HeldClaim | None = None,
) -> Committed:
    """Commit what `advance` decided, at `header.version`, with what the step counted, the ids of
    the live output it wrote (deleted by the commit) and, in the same round trip, the end of its
    model call under fleet limits, and in the commit itself its claims on the budgets above;
    returns what `Store.commit` does."""
    record = commit_record(header, owner, t, request=request, calls=calls, counts=counts, deltas=deltas, claim=claim)
    return store.commit(record, now=now, release=release)


def _refused(begun: Begun, version: int) -> StepResult:
    """A step `begin_step` refused: at a stale version, it reports the session's current one."""
    outcome = _STEP_OUTCOMES.get(begun.outcome, "missing")
    if outcome == "stale" and begun.detail.isdigit():
        return StepResult(outcome=outcome, version=int(begun.detail))
    return StepResult(outcome=outcome, version=version)


def _safe_end(
    store: Store, session_id: str, owner: str, request: str, reason: str, keep_owed: bool, counts: Counts
) -> None:
    """End the step if Redis answers at once (one try: else its lease lapses on its own, and what
    it counted is not counted)."""
    with contextlib.suppress(Exception):
        store.at_once().end_step(
            session_id, owner, request, reason, keep_owed=keep_owed, outcome="error", counts=counts
        )
