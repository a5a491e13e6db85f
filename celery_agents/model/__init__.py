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
    load_agent_file,
    parse_agent,
)
from celery_agents.model.calls import FINAL_STATES, CallState, TrackedCall, call_field
from celery_agents.model.session import (
    CompletionOutcome,
    Drive,
    ErrorInfo,
    PendingCall,
    SessionHeader,
    SessionView,
    State,
    Status,
)
from celery_agents.model.turns import (
    LlmTurn,
    Media,
    PartialUserTurn,
    StoredTurn,
    ToolCall,
    ToolResponse,
    Turn,
    Usage,
    UserQuery,
    UserTurn,
)

__all__ = [
    "DISPOSITION_TAGS",
    "FINAL_STATES",
    "AgentSpec",
    "CallState",
    "CompletionOutcome",
    "Disposition",
    "DispositionTag",
    "Drive",
    "ErrorInfo",
    "LlmTurn",
    "Media",
    "PartialUserTurn",
    "PendingCall",
    "PolicyRule",
    "SessionHeader",
    "SessionView",
    "State",
    "Status",
    "StoredTurn",
    "ToolCall",
    "ToolCallPolicy",
    "ToolResponse",
    "ToolSpec",
    "TrackedCall",
    "Turn",
    "Usage",
    "UserQuery",
    "UserTurn",
    "agent_json_schema",
    "call_field",
    "load_agent_file",
    "parse_agent",
]
