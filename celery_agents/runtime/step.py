"""Running one step: take the lease, decide with the scheduler, commit atomically.

Used the same way by the Celery `step` task and by the CLI's inline mode. What to publish after
the commit (tool tasks, the next step) is returned to the caller.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import redis

from celery_agents import observe
from celery_agents.errors import RedisUnavailable, UntrustedSpec
from celery_agents.model import ErrorInfo, ScriptOutcome, SessionHeader, State, StepOutcome, TrackedCall, UserQuery
from celery_agents.runtime.faults import checkpoint
from celery_agents.runtime.lease import LeaseKeeper
from celery_agents.runtime.ports import Fence, JournaledLlm, JournaledTools, RedisClock, SecureIds
from celery_agents.scheduler import Ports, Snapshot, Transition, advance
from celery_agents.scheduler.ports import Clock, Ids, LlmPort, ToolPort
from celery_agents.store import LeaseLost, Store
from celery_agents.store.commit import commit_record
from celery_agents.store.records import Begun, Committed, Loaded

log = logging.getLogger("celery_agents.step")

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
    llm_reused: bool = False
    #: the session is a child: its parent's id (a child that ends settles its parent's call)
    parent: str | None = None


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
) -> StepResult:
    """One step of `session_id` at `version` under `owner`. `pause_on_interrupt` (a step run by the
    command that drives the session, which nothing else drives): Ctrl-C pauses the session."""
    begun = store.begin_step(session_id, version, owner, request)
    loaded = begun.loaded
    if loaded is None:
        return _refused(begun, version)
    try:
        t, llm_reused = _decide(store, loaded, owner, llm, tools, clock, ids)
    except LeaseLost as exc:
        # Frozen or cut off long enough for another worker to take over: that worker owns the
        # step now; this one starts nothing more and leaves the session alone.
        log.warning("%s: it starts and writes nothing more", exc)
        return StepResult(outcome="lost", version=version)
    except KeyboardInterrupt:
        # Ctrl-C of an inline step: let the session go now, not when the lease lapses (30 s). Paused,
        # it is owed nothing until `resume` or `step`; the pause comes first, while the lease still
        # holds, or a worker's sweeper could take the step up in between. Otherwise the step stays
        # owed, for the next `resume` or a worker.
        if pause_on_interrupt:
            with contextlib.suppress(Exception):
                store.set_drive(session_id, "manual")
        _safe_end(store, session_id, owner, request, "interrupted", keep_owed=True)
        checkpoint("step_interrupted", store, session_id)
        raise
    except (RedisUnavailable, redis.ConnectionError, redis.TimeoutError):
        # Infrastructure, not the session: leave it owed so that it is tried again.
        _safe_end(store, session_id, owner, request, "error", keep_owed=True)
        raise
    except Exception as exc:
        return _failed(store, loaded.header, owner, exc)
    return _settle(store, loaded.header, owner, request, t, llm_reused)


def _decide(
    store: Store, loaded: Loaded, owner: str, llm: LlmPort, tools: ToolPort, clock: Clock | None, ids: Ids | None
) -> tuple[Transition, bool]:
    """The step's transition, decided under the session's lease with journaled ports; and whether
    the model's answer was the journal's (a redelivered step an older release had journaled)."""
    header = loaded.header
    with LeaseKeeper(store, store.keys.lease(header.session_id), owner) as keeper:
        agent = store.agent(header.agent_hash)
        fence = Fence(owner, header.version, lambda: keeper.lost)
        journaled_llm = JournaledLlm(store, loaded.journal, llm, fence)
        ports = Ports(
            llm=journaled_llm,
            tools=JournaledTools(store, loaded.journal, tools, fence),
            clock=clock or RedisClock(loaded.redis_now),
            ids=ids or SecureIds(),
        )
        inbox = _inbox_of_step(store, header.session_id, loaded, fence)
        snap = Snapshot(header=header, agent=agent, turns=loaded.turns, calls=loaded.calls, inbox=inbox)
        t = advance(snap, ports)
        t.calls = observe.stamp_deferred(t.calls)
        return t, journaled_llm.reused


def _failed(store: Store, header: SessionHeader, owner: str, exc: Exception) -> StepResult:
    """The step raised: the session fails with the error recorded (resumable once it is fixed)."""
    session_id, version = header.session_id, header.version
    if isinstance(exc, UntrustedSpec):
        # Not the session's fault to retry away: its spec was not stored by a holder of the key.
        log.warning("step of session %s refused: %s", session_id, exc.message)
        error = ErrorInfo(code=exc.code, message=exc.message)
    else:
        log.exception("step of session %s at version %s failed", session_id, version, exc_info=exc)
        error = ErrorInfo(code="internal_error", message=f"{type(exc).__name__}: {exc}")
    store.fail_step(session_id, version, error, owner)
    return StepResult(outcome="failed", version=version + 1, state=State.FAILED, parent=header.parent)


def _settle(
    store: Store, header: SessionHeader, owner: str, request: str, t: Transition, llm_reused: bool
) -> StepResult:
    """Commit the transition (or end the step when there is nothing to write)."""
    session_id, version = header.session_id, header.version
    if not t.commit:
        store.end_step(session_id, owner, request, t.kind)
        return StepResult(outcome="waiting" if t.kind == "wait" else "noop", version=version, state=t.state)
    done = commit_transition(store, header, owner, t, request=request)
    if done.outcome != "ok":
        log.info("step of session %s at version %s not committed: %s", session_id, version, done.outcome)
        return StepResult(outcome=_STEP_OUTCOMES.get(done.outcome, "lost"), version=version)
    return StepResult(
        outcome="committed",
        version=done.version,
        state=t.state,
        dispatch=t.dispatch,
        owed=done.owed,
        llm_reused=llm_reused,
        parent=header.parent,
    )


def _inbox_of_step(store: Store, session_id: str, loaded: Loaded, fence: Fence) -> list[UserQuery]:
    """The queued messages this step delivers: the ones it read, unless an earlier copy of the step
    journaled fewer (a model answer it journaled, as older releases did, saw only those; the later
    ones wait their turn)."""
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
) -> Committed:
    """Commit what `advance` decided, at `header.version`; returns what `Store.commit` does."""
    return store.commit(commit_record(header, owner, t, request=request, calls=calls), now=now)


def _refused(begun: Begun, version: int) -> StepResult:
    """A step `begin_step` refused: at a stale version, it reports the session's current one."""
    outcome = _STEP_OUTCOMES.get(begun.outcome, "missing")
    if outcome == "stale" and begun.detail.isdigit():
        return StepResult(outcome=outcome, version=int(begun.detail))
    return StepResult(outcome=outcome, version=version)


def _safe_end(store: Store, session_id: str, owner: str, request: str, reason: str, keep_owed: bool) -> None:
    with contextlib.suppress(Exception):
        store.end_step(session_id, owner, request, reason, keep_owed=keep_owed)
