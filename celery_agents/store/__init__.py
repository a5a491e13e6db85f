"""Redis: the keyspace, the Lua scripts, session persistence and the embedded local default.

Nothing here knows about Celery or the model.
"""

# First: redis-py is loaded with OpenTelemetry out of its sight (connection.py says why).
import celery_agents.store.connection  # noqa: F401  # isort: skip
from celery_agents.redis_urls import is_sentinel_url
from celery_agents.store.calls import Decision
from celery_agents.store.connection import broker_url, client_for_url, state_url
from celery_agents.store.embedded import EmbeddedRedis
from celery_agents.store.keys import FINISHED_STATES, Keys
from celery_agents.store.store import (
    Begun,
    Committed,
    Delta,
    Finished,
    InterruptWatch,
    LeaseLost,
    Loaded,
    Store,
    check_session_id,
    completion_json,
    new_session_id,
    new_token,
    outcome_json,
    parse_token,
)
from celery_agents.store.stream import COMPLETIONS_GROUP, CompletionStream, GroupState, RawEntry

__all__ = [
    "COMPLETIONS_GROUP",
    "FINISHED_STATES",
    "Begun",
    "Committed",
    "CompletionStream",
    "Decision",
    "Delta",
    "EmbeddedRedis",
    "Finished",
    "GroupState",
    "InterruptWatch",
    "Keys",
    "LeaseLost",
    "Loaded",
    "RawEntry",
    "Store",
    "broker_url",
    "check_session_id",
    "client_for_url",
    "completion_json",
    "is_sentinel_url",
    "new_session_id",
    "new_token",
    "outcome_json",
    "parse_token",
    "state_url",
]
