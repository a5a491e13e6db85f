"""The pure core: the step state machine, the tool-call policy and message building.

No I/O happens here; the outside world comes in through `ports`.
"""

from celery_agents.model.policy import disposition_for
from celery_agents.scheduler.machine import Event, Snapshot, Transition, advance, response_for, responses_turn
from celery_agents.scheduler.messages import build_messages, tool_content
from celery_agents.scheduler.ports import (
    Clock,
    Ids,
    LlmFailure,
    LlmPort,
    LlmRequest,
    Ports,
    ToolPort,
)

__all__ = [
    "Clock",
    "Event",
    "Ids",
    "LlmFailure",
    "LlmPort",
    "LlmRequest",
    "Ports",
    "Snapshot",
    "ToolPort",
    "Transition",
    "advance",
    "build_messages",
    "disposition_for",
    "response_for",
    "responses_turn",
    "tool_content",
]
