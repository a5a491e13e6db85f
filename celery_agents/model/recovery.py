"""What becomes of an owed step or a dispatched call when its worker may have died: the one rule,
pure. The sweeper applies it atomically per entry (store/lua/sweep_owed.lua and
sweep_dispatched.lua, checked against `recovery_decision` by tests/store/test_recovery.py);
`agents doctor` counts with it the entries whose worker died. It lives beside the model's other
closed sets rather than in `scheduler`, which commands that read (doctor, list) never import."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Recovery(StrEnum):
    """The sweeper's verdict on one entry (the values the sweep scripts return)."""

    #: nothing is owed any more (committed, finished, cancelled): the entry goes
    SETTLED = "settled"
    #: a worker holds its lease: it runs now
    RUNNING = "running"
    #: never picked up, and its message may still wait in its queue: left alone
    WAITING = "waiting"
    #: published again: its worker died (picked up, lease lapsed) or its message was lost
    REPUBLISH = "republish"


@dataclass(frozen=True)
class Entry:
    """What is known of an owed step (or dispatched call) older than the owed grace."""

    #: the step is still owed at the session's version (the call is still unfinished)
    owed: bool
    #: a worker holds its lease now
    leased: bool
    #: a worker picked it up (`picked` is the version; the call's `:call-started:` marker exists)
    picked: bool
    #: never picked up and its message cannot be waiting in its queue (see `tasks/services.py`)
    lost: bool = False


def recovery_decision(entry: Entry) -> Recovery:
    if not entry.owed:
        return Recovery.SETTLED
    if entry.leased:
        return Recovery.RUNNING
    if not entry.picked and not entry.lost:
        return Recovery.WAITING
    return Recovery.REPUBLISH


def worker_died(entry: Entry) -> bool:
    """Its worker picked it up and stopped renewing the lease: published again whatever its queue."""
    return recovery_decision(Entry(entry.owed, entry.leased, entry.picked, lost=False)) is Recovery.REPUBLISH
