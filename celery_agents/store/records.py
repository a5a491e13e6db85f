"""What the store hands back: a loaded session, a finished call, a swept entry, a refusal."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from celery_agents.model import (
    LlmTurn,
    PendingCall,
    QueuedMessage,
    ScriptOutcome,
    SessionHeader,
    TrackedCall,
    UserQuery,
    UserTurn,
)
from celery_agents.model.recovery import Recovery


class LeaseLost(Exception):
    """A step's session lease is held by another worker, or the session moved past the step's
    version: the step must start nothing more and write nothing (fencing)."""


@dataclass(frozen=True)
class LeaseRef:
    """A lease to renew: its key and owner; for a step's lease also its session's header and the
    step's version (a lapsed step lease is taken again only while the session is still there).
    `slot`: a model call's slot under a concurrency limit (`key` the KEY's slots in flight,
    `owner` the slot's id), renewed while it is there, never taken again. `claim`: a step's claim
    on a budget above it (`key` that session's claims, `owner` the claim's member), the same."""

    key: str
    owner: str
    header: str = ""
    version: int = 0
    slot: bool = False
    claim: bool = False


#: what renewing a lease did (store/lua/lease_renew.lua): extended it, took it again after it
#: lapsed with nobody else taking it, or found it lost
Renewal = Literal["renewed", "retaken", "lost"]


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
    #: someone follows the session's events (`keys.watch`): its model call streams
    watched: bool = False


class Live(NamedTuple):
    """What a session's view shows besides its header."""

    pending: list[PendingCall]
    leased: bool
    children: list[str]
    #: user messages waiting for the next model call, oldest first
    queued: list[QueuedMessage]


@dataclass(frozen=True)
class Begun:
    """What `begin_step` did: `outcome` "ok" with the session `loaded`, or a refusal ("stale",
    "busy", "ended", "missing") with its `detail`: the current version, the lease holder, the
    status."""

    outcome: ScriptOutcome
    loaded: Loaded | None = None
    detail: str = ""


@dataclass(frozen=True)
class Sent:
    """What `send_message` did: the session's version, the messages now queued (this one
    included, unless it continued a completed session), and whether it `continued` one."""

    version: int
    waiting: int
    continued: bool


@dataclass(frozen=True)
class Committed:
    """What `commit` did: `outcome` "ok" with the session's new `version` and whether the next
    step is `owed`, or a refusal ("stale", "ended", "lost_lease", "missing"); `released`: what
    ending the step's model call under fleet limits did, when the commit sent it."""

    outcome: ScriptOutcome
    version: int = 0
    owed: bool = False
    released: Released | None = None


@dataclass
class Finished:
    """What recording a call's outcome did: "ok", or the script's refusal ("already", "unknown",
    "missing", "gone", "early", ...)."""

    status: ScriptOutcome
    remaining: int = 0
    woken: bool = False
    version: int = 0
    #: the session's priority (a wake is published with it)
    priority: int = 5


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
    #: the session's priority (a step published again keeps it)
    priority: int = 5


@dataclass(frozen=True)
class Waiter:
    """A step waiting for a slot under a concurrency limit, woken by a released slot."""

    session_id: str
    version: int
    priority: int

    @property
    def member(self) -> str:
        return f"{self.session_id} {self.version} {self.priority}"

    @classmethod
    def from_member(cls, member: str) -> Waiter:
        sid, version, priority = member.split(" ")
        return cls(sid, int(version), int(priority))


@dataclass(frozen=True)
class Released:
    """What release.lua did: the pause it recorded (seconds, Redis's clock), the waiters it woke;
    `now`: Redis's clock then."""

    now: float
    paused_until: float | None = None
    woken: tuple[Waiter, ...] = ()
