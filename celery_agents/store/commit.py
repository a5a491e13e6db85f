"""A step's commit as one record: built once from what the scheduler decided, serialised once for
`lua/commit_step.lua` (`to_args`).

The header fields a step sets travel as their hash text (`header.header_texts` of the header
after the step), so a new header field reaches Redis without touching the script.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from celery_agents.model import CallState, LlmTurn, SessionHeader, Spend, State, Status, TrackedCall, UserTurn
from celery_agents.store.budget import HeldClaim
from celery_agents.store.codec import turn_digest
from celery_agents.store.counters import CounterKey, counter_field
from celery_agents.store.header import ERROR_CODE, header_texts, sparse_update
from celery_agents.store.summary import step_summary

if TYPE_CHECKING:  # the scheduler is imported by steps, not by commands that only read
    from celery_agents.scheduler import Transition

#: the header fields a commit sets as they are (version, turn_count and steps are counted up by the
#: script, state goes through its index, drive is read there: a pause during the step must hold)
_SET_FIELDS = ("head", "status", "usage", "response", "error", ERROR_CODE, "turns_digest")


@dataclass(frozen=True)
class CommitRecord:
    """Everything `commit_step.lua` writes for one step of one session."""

    session_id: str
    #: the version the step read: the commit is refused at any other
    version: int
    owner: str
    kind: str
    request: str
    turns: tuple[UserTurn | LlmTurn, ...]
    #: each new turn as stored (JSON), digested as stored
    turn_jsons: tuple[str, ...]
    calls: tuple[TrackedCall, ...]
    #: header fields the step sets, as their hash text
    meta: Mapping[str, str]
    state: State
    steps_inc: int
    #: the step leaves another one owed (if the session is still auto-driven when it commits)
    owe: bool
    events: tuple[tuple[str, str], ...]
    #: the transcript the step read: the cache is extended only from this one
    base_turn_count: int
    base_digest: str
    #: how many of the oldest queued user messages the step delivered (the commit removes them)
    inbox_taken: int = 0
    #: what the step counted (model calls, tokens, inline tool calls), for the fleet's counters
    counts: Mapping[CounterKey, int] = field(default_factory=dict)
    #: what the step spent (its model call, the tool calls it started)
    spend: Spend = field(default_factory=Spend)
    #: the sessions above this one, its parent first: the spend is theirs too
    above: tuple[str, ...] = ()
    #: what the step did, in one line (`session history`)
    summary: str = ""
    #: the ids of the deltas its model call streamed to the session's events: the commit deletes them
    deltas: tuple[str, ...] = ()
    #: the step's claims on the budgets of the session and those above it (store/budget.py): the commit ends them
    claim: HeldClaim | None = None

    @property
    def turns_digest(self) -> str:
        return self.meta["turns_digest"]

    @property
    def tokens(self) -> list[TrackedCall]:
        """The deferred calls whose tokens the commit creates, in the order of their keys."""
        return [c for c in self.calls if c.state == CallState.DEFERRED and c.token]

    def to_args(self, attempt: str, lease_ms: int) -> list[str]:
        """The script's arguments: the record as JSON, then each new turn's JSON and each call's,
        verbatim (not escaped into the record: they are most of its bytes). `attempt` names this
        call of the script (a retry after a lost reply resends it and gets the first reply back);
        `lease_ms` is how long a lease lasts (another worker's lease found is put back with it)."""
        control = self._control(attempt, lease_ms)
        return [control, *self.turn_jsons, *(c.stored_json() for c in self.calls)]

    def _control(self, attempt: str, lease_ms: int) -> str:
        body: dict[str, Any] = {
            "version": str(self.version),
            "owner": self.owner,
            "attempt": attempt,
            "lease_ms": lease_ms,
            "kind": self.kind,
            "request": self.request,
            "n_turns": len(self.turn_jsons),
            "calls": [c.field for c in self.calls],
            "meta": dict(self.meta),
            "state": self.state.value,
            "steps_inc": self.steps_inc,
            "owe": self.owe,
            "batch": self.calls[0].batch if self.calls else -1,
            "batch_size": len(self.calls),
            "pending": [[c.field, int(c.created_at * 1000)] for c in self.calls if not c.state.final],
            "dispatched": [c.field for c in self.calls if c.state == CallState.RUNNING],
            "tokens": [token_record(c) for c in self.tokens],
            "events": [list(e) for e in self.events],
            "inbox_taken": self.inbox_taken,
            "counts": [[counter_field(k), n] for k, n in self.counts.items() if n],
            "n_above": len(self.above),
            "summary": self.summary,
        }
        if not self.spend.nothing:
            sp = self.spend
            body["spend"] = [sp.tokens, sp.cost_usd, sp.model_calls, sp.tool_calls]
        if self.deltas:
            body["deltas"] = list(self.deltas)
        if self.claim is not None:
            body["claim"], body["n_claims"] = self.claim.member, len(self.claim.above)
            # whose header each claim's budget is: 0 this session's, j the j-th above
            body["claim_at"] = [0 if s == self.session_id else self.above.index(s) + 1 for s in self.claim.above]
        return json.dumps(body, ensure_ascii=False)


def token_record(c: TrackedCall) -> list[Any]:
    """A deferred call's token as commit_step.lua and fork_session.lua create it: field, deadline
    (ms), call id, tool, digest, reason, child, gate."""
    return [
        c.field,
        int((c.expires_at or 0) * 1000),
        c.call_id,
        c.tool,
        c.digest(),
        c.reason or "",
        c.meta.child or "",
        c.then or "",
    ]


def commit_record(
    header: SessionHeader,
    owner: str,
    t: Transition,
    *,
    request: str = "",
    calls: list[TrackedCall] | None = None,
    counts: Mapping[CounterKey, int] | None = None,
    deltas: tuple[str, ...] = (),
    claim: HeldClaim | None = None,
) -> CommitRecord:
    """The record committing what `advance` decided for the session in `header` (`calls`: the
    calls to write instead of the transition's; `counts`: what the step counted; `deltas`: the
    ids of the live output its model call wrote, deleted by the commit; `claim`: its claims on the
    budgets above, ended by the commit)."""
    turn_jsons = tuple(turn.model_dump_json(exclude_none=True) for turn in t.new_turns)
    after = header.model_copy(
        update={
            "head": t.head,
            "status": t.status,
            "response": t.response,
            "error": t.error,
            "usage": header.usage + t.usage,
            # Sessions stored before digests keep none (their count is checked instead).
            "turns_digest": turn_digest(header.turns_digest, list(turn_jsons)) if header.turns_digest else "",
        }
    )
    written = tuple(t.calls if calls is None else calls)
    return CommitRecord(
        session_id=header.session_id,
        version=header.version,
        owner=owner,
        kind=t.kind,
        request=request,
        turns=tuple(t.new_turns),
        turn_jsons=turn_jsons,
        calls=written,
        meta=sparse_update(header_texts(header, _SET_FIELDS), header_texts(after, _SET_FIELDS)),
        state=t.state,
        steps_inc=1 if t.counts_as_step else 0,
        owe=t.status == Status.ACTIVE and t.state.owes_step,
        events=tuple((e.type, json.dumps(e.data, ensure_ascii=False, separators=(",", ":"))) for e in t.events),
        base_turn_count=header.turn_count,
        base_digest=header.turns_digest,
        inbox_taken=t.inbox_taken,
        counts=dict(counts or {}),
        spend=t.spend,
        above=tuple(header.ancestors),
        summary=step_summary(t.kind, t.new_turns, written),
        deltas=deltas,
        claim=claim,
    )
