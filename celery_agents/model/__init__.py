"""Pydantic models of celery-agents: agent file, session, turns, tracked calls, views.

Nothing here imports Redis, Celery or litellm.
"""

from celery_agents.model.agent import (
    DISPOSITION_TAGS,
    AgentSpec,
    Disposition,
    DispositionTag,
    PolicyRule,
    ToolCallPolicy,
    ToolSpec,
    agent_json_schema,
    arguments_not_an_object,
    load_agent_file,
    parse_agent,
)
from celery_agents.model.calls import FINAL_STATES, CallState, OutcomeState, TrackedCall, call_field
from celery_agents.model.protocol import (
    FINAL_EVENTS,
    REFUSALS,
    SCRIPT_OUTCOMES,
    EventType,
    ScriptOutcome,
    StepOutcome,
)
from celery_agents.model.session import (
    STEP_OWING_STATES,
    CompletionOutcome,
    Drive,
    ErrorInfo,
    PendingCall,
    SessionHeader,
    SessionView,
    State,
    Status,
    child_session_id,
)
from celery_agents.model.turns import (
    LlmTurn,
    Media,
    StoredTurn,
    ToolCall,
    ToolResponse,
    Usage,
    UserQuery,
    UserTurn,
)


def build_schemas() -> None:
    """Build every model's validator now; models of the agent file and the turns are otherwise
    built on first use. A worker calls this once before forking its pool processes, which then
    share them instead of each building its own."""
    from pydantic import BaseModel

    from celery_agents.model import agent, calls, session, turns

    for module in (agent, calls, session, turns):
        for value in vars(module).values():
            defined_here = isinstance(value, type) and value.__module__ == module.__name__
            if defined_here and issubclass(value, BaseModel) and not value.__pydantic_complete__:
                value.model_rebuild()


__all__ = [
    "DISPOSITION_TAGS",
    "FINAL_EVENTS",
    "FINAL_STATES",
    "REFUSALS",
    "SCRIPT_OUTCOMES",
    "STEP_OWING_STATES",
    "AgentSpec",
    "CallState",
    "CompletionOutcome",
    "Disposition",
    "DispositionTag",
    "Drive",
    "ErrorInfo",
    "EventType",
    "LlmTurn",
    "Media",
    "OutcomeState",
    "PendingCall",
    "PolicyRule",
    "ScriptOutcome",
    "SessionHeader",
    "SessionView",
    "State",
    "Status",
    "StepOutcome",
    "StoredTurn",
    "ToolCall",
    "ToolCallPolicy",
    "ToolResponse",
    "ToolSpec",
    "TrackedCall",
    "Usage",
    "UserQuery",
    "UserTurn",
    "agent_json_schema",
    "arguments_not_an_object",
    "build_schemas",
    "call_field",
    "child_session_id",
    "load_agent_file",
    "parse_agent",
]
