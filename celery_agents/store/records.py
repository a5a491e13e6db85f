"""What the store hands back: a loaded session, a finished call, a swept entry, a refusal."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from celery_agents.model import LlmTurn, PendingCall, ScriptOutcome, SessionHeader, TrackedCall, UserQuery, UserTurn
from celery_agents.model.recovery import Recovery


class LeaseLost(Exception):
    """A step's session lease is held by another worker, or the session moved past the step's
    version: the step must start nothing more and write nothing (fencing)."""


@dataclass
class Loaded:
    """A session as a step reads it."""

    header: SessionHeader
    turns: list[UserTurn | LlmTurn]
    #: the newest batch's calls with their outcomes, at head `PartialUserTurn` (else empty: no other
    #: step reads them)
    calls: list[TrackedCall]
    lease_holder: str
    journal: dict[str, str]
    #: Redis's clock when the step began (seconds; 0 when not read): the step's times come from it
    redis_now: float = 0.0
    #: user messages sent meanwhile (`session send`), oldest first, not yet delivered
    inbox: list[UserQuery] = field(default_factory=list)


class Live(NamedTuple):
    """What a session's view shows besides its header."""

    pending: list[PendingCall]
    leased: bool
    children: list[str]


@dataclass(frozen=True)
class Begun:
    """What `begin_step` did: `outcome` "ok" with the session `loaded`, or a refusal ("stale",
    "busy", "ended", "missing") with its `detail`: the current version, the lease holder, the
    status."""

    outcome: ScriptOutcome
    loaded: Loaded | None = None
    detail: str = ""


@dataclass(frozen=True)
class Committed:
    """What `commit` did: `outcome` "ok" with the session's new `version` and whether the next
    step is `owed`, or a refusal ("stale", "ended", "lost_lease", "missing")."""

    outcome: ScriptOutcome
    version: int = 0
    owed: bool = False


@dataclass
class Finished:
    """What recording a call's outcome did: "ok", or the script's refusal ("already", "unknown",
    "missing", "gone", "early", ...)."""

    status: ScriptOutcome
    remaining: int = 0
    woken: bool = False
    version: int = 0


@dataclass(frozen=True)
class Transcript:
    """The turns of one session this process has read, with their digest and the version seen.
    Never changed once cached (a commit caches a new one): steps in other threads of the process
    may be reading it."""

    turns: list[UserTurn | LlmTurn]
    digest: str
    version: int


#: what the sweeper does with an outbox entry or a dispatched call (store/lua/sweep_*.lua): the
#: verdicts of `model.recovery.recovery_decision`, the one rule the scripts apply
SweepVerdict = Recovery


@dataclass
class Swept:
    """One outbox entry (`field` None) or dispatched call as the sweeper settled it; `version` is
    the step to publish again, `call` the call to publish again."""

    session_id: str
    verdict: SweepVerdict
    field: str | None = None
    version: int = 0
    call: TrackedCall | None = None
