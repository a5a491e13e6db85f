"""Pydantic models of celery-agents: agent file, session, turns, tracked calls, views.

Data only: nothing here imports Redis, Celery or litellm, nor any tool. Reading an agent file
(`agent_file.py`) validates it and runs, imports and connects nothing; `celery_agents.tools.resolve`
finds the tools it leaves to be found.
"""

from celery_agents.model.agent import (
    DISPOSITION_TAGS,
    AgentSpec,
    Disposition,
    DispositionTag,
    Lane,
    PolicyRule,
    ToolCallPolicy,
    ToolSpec,
    agent_json_schema,
    arguments_not_an_object,
)
from celery_agents.model.agent_file import AgentFile, Resolution, read_agent, read_agent_file
from celery_agents.model.budget import BUDGET_KINDS, Budget, BudgetKind, Spend, parse_grant
from celery_agents.model.calls import (
    FINAL_STATES,
    CallMeta,
    CallOutcome,
    CallState,
    OutcomeState,
    TrackedCall,
    call_digest,
    call_field,
)
from celery_agents.model.protocol import (
    DELTA_EVENTS,
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
    ForkOrigin,
    PendingCall,
    QueuedMessage,
    SessionHeader,
    SessionView,
    State,
    Status,
    VersionEntry,
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

    from celery_agents.model import agent, budget, calls, session, turns

    for module in (agent, budget, calls, session, turns):
        for value in vars(module).values():
            defined_here = isinstance(value, type) and value.__module__ == module.__name__
            if defined_here and issubclass(value, BaseModel) and not value.__pydantic_complete__:
                value.model_rebuild()


__all__ = [
    "BUDGET_KINDS",
    "DELTA_EVENTS",
    "DISPOSITION_TAGS",
    "FINAL_EVENTS",
    "FINAL_STATES",
    "REFUSALS",
    "SCRIPT_OUTCOMES",
    "STEP_OWING_STATES",
    "AgentFile",
    "AgentSpec",
    "Budget",
    "BudgetKind",
    "CallMeta",
    "CallOutcome",
    "CallState",
    "CompletionOutcome",
    "Disposition",
    "DispositionTag",
    "Drive",
    "ErrorInfo",
    "EventType",
    "ForkOrigin",
    "Lane",
    "LlmTurn",
    "Media",
    "OutcomeState",
    "PendingCall",
    "PolicyRule",
    "QueuedMessage",
    "Resolution",
    "ScriptOutcome",
    "SessionHeader",
    "SessionView",
    "Spend",
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
    "VersionEntry",
    "agent_json_schema",
    "arguments_not_an_object",
    "build_schemas",
    "call_digest",
    "call_field",
    "child_session_id",
    "parse_grant",
    "read_agent",
    "read_agent_file",
]
