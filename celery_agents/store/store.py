"""Session persistence in Redis: `Store`, assembled from one part per concern.

Every write that must be atomic is one script of `store/lua/`; reads are single round trips
(a script or a pipeline). Writes per step carry only the step's new turns and calls. The parts:
`core` (client, scripts, header, locks), `sessions`, `steps` (load, journal, commit), `calls`
(outcomes, tokens, deadlines), `sweep` (outbox, dispatched calls), `views`, `ledger` (a dispatched
call as its worker sees it), `fleet` (heartbeats, sweeper's turn, completions stream), `recovery`
(what the sweeper and doctor read of owed and dispatched work), `history` (versions, forks),
`health` (what doctor reads),
`durability` (waiting until Redis's append-only file holds a write), `live` (a streaming answer's
deltas, the interrupts of `send --interrupt`), `counters` (the fleet's counters, where no script
adds them) and `admission` (the fleet's limits on model calls); stored shapes are
in `codec`, returned values in `records`, ids and tokens in `ids`.
"""

from __future__ import annotations

from celery_agents.store.calls import CallStore
from celery_agents.store.codec import (
    completion_json,
    event_from_entry,
    merge_outcome,
    outcome_json,
    pending_view,
    turn_digest,
)
from celery_agents.store.counters import CounterStore
from celery_agents.store.durability import Durability
from celery_agents.store.fleet import Fleet
from celery_agents.store.header import header_from_hash, header_to_hash
from celery_agents.store.health import Health
from celery_agents.store.history import HistoryStore
from celery_agents.store.ids import check_session_id, new_session_id, new_token, parse_token
from celery_agents.store.ledger import CallLedger
from celery_agents.store.live import Delta, InterruptWatch, LiveStore
from celery_agents.store.records import Begun, Committed, Finished, LeaseLost, Loaded, SweepVerdict, Swept
from celery_agents.store.recovery import RecoveryReads
from celery_agents.store.sessions import SessionStore
from celery_agents.store.steps import JOURNAL_TTL_S, StepStore
from celery_agents.store.sweep import SweepStore
from celery_agents.store.views import ViewStore

__all__ = [
    "JOURNAL_TTL_S",
    "Begun",
    "Committed",
    "Delta",
    "Finished",
    "InterruptWatch",
    "LeaseLost",
    "Loaded",
    "Store",
    "SweepVerdict",
    "Swept",
    "check_session_id",
    "completion_json",
    "event_from_entry",
    "header_from_hash",
    "header_to_hash",
    "merge_outcome",
    "new_session_id",
    "new_token",
    "outcome_json",
    "parse_token",
    "pending_view",
    "turn_digest",
]


class Store(
    SessionStore,
    StepStore,
    CallStore,
    SweepStore,
    ViewStore,
    CallLedger,
    Fleet,
    Health,
    Durability,
    RecoveryReads,
    CounterStore,
    HistoryStore,
    LiveStore,
):
    """Session state in Redis under one key prefix."""
