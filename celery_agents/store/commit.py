"""A step's commit as one record: built once from what the scheduler decided, serialised once for
`lua/commit_step.lua` (`to_args`).

The header fields a step sets travel as their hash text (`header.header_to_hash` of the header
after the step), so a new header field reaches Redis without touching the script.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery_agents.model import CallState, LlmTurn, SessionHeader, State, Status, TrackedCall, UserTurn
from celery_agents.store.codec import turn_digest
from celery_agents.store.header import ERROR_CODE, header_to_hash

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
        return [control, *self.turn_jsons, *(c.model_dump_json(exclude_defaults=True) for c in self.calls)]

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
            "tokens": [
                [
                    c.field,
                    int((c.expires_at or 0) * 1000),
                    c.call_id,
                    c.tool,
                    c.digest(),
                    c.reason or "",
                    str(c.meta.get("child") or ""),
                ]
                for c in self.tokens
            ],
            "events": [list(e) for e in self.events],
            "inbox_taken": self.inbox_taken,
        }
        return json.dumps(body, ensure_ascii=False)


def commit_record(
    header: SessionHeader,
    owner: str,
    t: Transition,
    *,
    request: str = "",
    calls: list[TrackedCall] | None = None,
) -> CommitRecord:
    """The record committing what `advance` decided for the session in `header` (`calls`: the
    calls to write instead of the transition's)."""
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
    stored = header_to_hash(after)
    return CommitRecord(
        session_id=header.session_id,
        version=header.version,
        owner=owner,
        kind=t.kind,
        request=request,
        turns=tuple(t.new_turns),
        turn_jsons=turn_jsons,
        calls=tuple(t.calls if calls is None else calls),
        meta={name: stored[name] for name in _SET_FIELDS},
        state=t.state,
        steps_inc=1 if t.counts_as_step else 0,
        owe=t.status == Status.ACTIVE and t.state.owes_step,
        events=tuple((e.type, json.dumps(e.data, ensure_ascii=False)) for e in t.events),
        base_turn_count=header.turn_count,
        base_digest=header.turns_digest,
        inbox_taken=t.inbox_taken,
    )
