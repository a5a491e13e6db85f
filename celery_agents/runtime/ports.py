"""The scheduler's ports bound to the real world, and journaling around the costly ones.

Each inline tool result is written to the session's journal as soon as it exists (several tools
may run before the step commits, and they touch the world): a redelivered copy of the step finds
it there and does not run the tool again. The model's response is not journaled: the model call is
the last thing a step does before its commit, so the response travels in the commit itself. A
worker killed after the model answered and before the commit costs at most one more model call
(the redelivered step asks again; a journal write would have protected only the window between two
consecutive Redis writes, as wide as the window between the answer and that write); once the
commit is done, the model is never asked again for that step. A step that lost its lease (its
worker was frozen and another took over) calls and runs nothing more: the fence is checked before each call (past
the lease's local deadline, by asking Redis), the journal script refuses its writes and the commit
refuses a step whose lease or version moved.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from celery_agents import observe
from celery_agents.model import AgentSpec, CallMeta, CallOutcome, LlmTurn, Media, TrackedCall, Usage
from celery_agents.runtime.faults import checkpoint
from celery_agents.scheduler.ports import LiveOutput, LlmInterrupted, LlmPort, LlmRequest, ToolPort
from celery_agents.store import LeaseLost, Store, new_token
from celery_agents.tools.output import bound_outcome


class SystemClock:
    def now(self) -> float:
        return time.time()


class RedisClock:
    """Redis's clock read when the step began, moved on by this process's monotonic clock: the times
    a step stamps (deadlines, creation times) agree with every worker's, whatever its host's clock says."""

    def __init__(self, redis_now: float) -> None:
        self._base, self._at = redis_now, time.monotonic()

    def now(self) -> float:
        return self._base + (time.monotonic() - self._at)


class SecureIds:
    def token(self, session_id: str) -> str:
        return new_token(session_id)

    def call_id(self) -> str:
        return f"call_{secrets.token_hex(8)}"


@dataclass(frozen=True)
class Fence:
    """Who runs a step, at which version, and whether it may still act under its lease."""

    owner: str
    version: int
    #: whether the step still holds its lease (`LeaseKeeper.holds`: past its local deadline, it asks Redis)
    holds: Callable[[], bool] = lambda: True
    #: whether the lease lapsed and was taken again (a worker that held it meanwhile may have journaled)
    retaken: Callable[[], bool] = lambda: False

    def check(self, session_id: str) -> None:
        """Raise `LeaseLost` before work the step may no longer own: a model call, a tool call, its commit."""
        if not self.holds():
            raise LeaseLost(f"the step of session {session_id} at version {self.version} lost its lease")


class FencedLlm:
    """The model call of a step, made only while the step holds its lease; its response is not
    journaled: the step's commit, which follows at once, writes it. The call streams to the step's
    `live` output, which also says when a message interrupts it."""

    def __init__(
        self,
        store: Store,
        inner: LlmPort,
        fence: Fence,
        live: LiveOutput | None = None,
        answered: Callable[[], None] | None = None,
    ) -> None:
        self.store, self.inner, self.fence, self.live = store, inner, fence, live
        #: told when the model has answered (its budget claim is spent from then on, committed or not)
        self.answered = answered

    def complete(self, request: LlmRequest) -> LlmTurn:
        self.fence.check(request.session_id)
        checkpoint("before_llm", self.store, request.session_id)
        if self.live is not None:
            if self.live.interrupted():  # before the model was asked: nothing spent
                raise LlmInterrupted(Usage(), model=request.agent.model, called=False)
            request = dataclasses.replace(request, live=self.live)
        turn = self.inner.complete(request)
        if self.answered is not None:
            self.answered()
        checkpoint("after_llm", self.store, request.session_id)
        return turn


def outcome_to_json(outcome: CallOutcome) -> str:
    data = {f.name: getattr(outcome, f.name) for f in dataclasses.fields(outcome)}
    data["media"] = [m.model_dump() for m in outcome.media]
    data["meta"] = outcome.meta.stored()
    return json.dumps(data, ensure_ascii=False, default=str)


def outcome_from_json(raw: str) -> CallOutcome:
    data = json.loads(raw)
    data["media"] = [Media.model_validate(m) for m in data.get("media", [])]
    data["meta"] = CallMeta.model_validate(data.get("meta") or {})
    return CallOutcome(**data)


class JournaledTools:
    """Reuses a journaled inline result of this call; journals a fresh one at once."""

    def __init__(self, store: Store, journal: dict[str, str], inner: ToolPort, fence: Fence) -> None:
        self.store, self.journal, self.inner, self.fence = store, journal, inner, fence

    def run(self, agent: AgentSpec, session_id: str, call: TrackedCall) -> CallOutcome:
        field = f"tool:{call.field}"
        raw = self.journal.get(field)
        if raw is None and self.fence.retaken():
            # Its lease lapsed and was taken again: a worker that held it meanwhile may have run the call.
            raw = self.store.journaled(session_id, field)
        if raw is None:
            self.fence.check(session_id)
            with observe.tool_call(agent, call) as watch:
                outcome = bound_outcome(self.inner.run(agent, session_id, call), self.store.settings.max_result_bytes)
                observe.tool_ran(watch, outcome)
            raw = self.store.journal_put(
                session_id, field, outcome_to_json(outcome), self.fence.owner, self.fence.version, effect=True
            )
        return outcome_from_json(raw)
