"""The closed sets of strings that cross between Python, the Lua scripts and the CLI, named once.

Event types are what a session's stream carries (`agents events`, the contract); script outcomes
are the first element of every `store/lua/` reply; step outcomes are what running one step did.
Tests hold the Lua scripts to these names (tests/store/test_lua_contract.py).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, get_args


class EventType(StrEnum):
    """The `type` of an entry in a session's event stream."""

    SESSION_STARTED = "session_started"
    STEP_STARTED = "step_started"
    STEP_SKIPPED = "step_skipped"
    STEP_NOOP = "step_noop"
    STEP_COMMITTED = "step_committed"
    LLM_CALLED = "llm_called"
    TOOL_DISPATCHED = "tool_dispatched"
    TOOL_FINISHED = "tool_finished"
    TOKEN_CREATED = "token_created"
    TOKEN_COMPLETED = "token_completed"
    TOKEN_EXPIRED = "token_expired"
    TOKEN_REJECTED = "token_rejected"
    COMPLETED = "completed"
    FAILED = "failed"
    PAUSED = "paused"
    RESUMED = "resumed"
    CANCELLED = "cancelled"
    #: a user message was queued (`session send`); `continued`: it reopened a completed session
    MESSAGE_QUEUED = "message_queued"
    CONTINUED = "continued"
    #: a person approved a deferred sub-agent call: it now starts its child session
    DELEGATION_APPROVED = "delegation_approved"
    #: a person approved an approval gate: the call now runs under its `then`
    CALL_APPROVED = "call_approved"
    #: a tenth of a deferred call's wait (at most an hour) remains
    CALL_EXPIRING = "call_expiring"
    #: a deferred call's deadline was moved (`session extend`)
    CALL_EXTENDED = "call_extended"
    #: a worker ran nothing of a dispatched call whose stored record disagrees with the signed spec
    CALL_REFUSED = "call_refused"
    #: the session was made as a fork of another (`session fork`, `session rerun`)
    FORKED = "forked"
    #: a fleet limit (or a model's pause) made the step's model call wait: the step was put back
    #: for the time it may start (`until`, `key`, `reason`)
    STEP_THROTTLED = "step_throttled"
    #: text and reasoning of a model answer as it streams, written before the step commits and
    #: removed by its commit (not the transcript: the committed turn is the truth); `{"text", "offset"}`
    TEXT_DELTA = "text_delta"
    REASONING_DELTA = "reasoning_delta"
    #: a model call was cancelled by a message sent with `--interrupt`: its partial answer dropped,
    #: its usage counted; the next model call includes the message
    MODEL_INTERRUPTED = "model_interrupted"


#: events after which a session has stopped for good
FINAL_EVENTS = frozenset({EventType.COMPLETED, EventType.FAILED, EventType.CANCELLED})
#: the events of an answer as it streams (live output, trimmed once its step commits)
DELTA_EVENTS = frozenset({EventType.TEXT_DELTA, EventType.REASONING_DELTA})

#: a script's reply that changed nothing (or only added an event): its `once` does not keep it for
#: retries (`_lib.lua` REFUSALS)
Refusal = Literal[
    "missing",
    "unknown",
    "exists",
    "stale",
    "ended",
    "lost_lease",
    "already",
    "early",
    "completed",
    "expired",
    "cancelled",
    "active",
    "changed",
    "busy",
    # send_message: as many messages wait as may
    "full",
    # complete_token: this very completions stream entry completed the token before
    "applied",
    # complete_token: approve or reject of a call that is not an approval gate; a decision made on
    # another digest than the pending call's
    "not_an_approval",
    "digest_mismatch",
    # the sweeper's verdicts (sweep_*.lua) but `republish`
    "settled",
    "running",
    "waiting",
]
#: the first element of a script's reply
ScriptOutcome = Literal[
    Refusal,
    "ok",
    # the sweeper's one verdict that changes something
    "republish",
    # expire_call: the call was final already or its token is gone
    "gone",
    # complete_token: this very call found the deadline passed and expired the call
    "expired_now",
    # journal_put: the step's lease is another's, or the session moved past its version;
    # record_result: the call's lease is another worker's (this one was frozen past it)
    "lost",
    # complete_token: the completion approved a deferred sub-agent call, which now starts its child
    "approved",
    # admit: a fleet limit has no room for the model call now; claim_budget: a budget above has
    # none beside the calls in flight
    "wait",
    # claim_budget: a limit of a budget above is reached
    "refuse",
]
SCRIPT_OUTCOMES: frozenset[str] = frozenset(get_args(ScriptOutcome))
REFUSALS: frozenset[str] = frozenset(get_args(Refusal))

#: what running one step did (`runtime.step.StepResult.outcome`): committed; waiting (calls still
#: unfinished) or noop (nothing to do); refused before starting: stale, busy, ended, missing; lost
#: (another worker took the lease over); failed (the session was failed by the step); throttled (a
#: fleet limit made its model call wait: the step was put back for the time it may start)
StepOutcome = Literal[
    "committed", "waiting", "noop", "stale", "busy", "ended", "missing", "lost", "failed", "throttled"
]
