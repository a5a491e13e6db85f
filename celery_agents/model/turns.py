"""Turns of a session's transcript, oldest first, as a discriminated union on `kind`.

`UserTurn` and `LlmTurn` are appended and never rewritten. While some tracked calls of the newest
`LlmTurn` are unfinished the session's head reads `PartialUserTurn` (a name only: the calls are
the ledger's); a `UserTurn` answering them is appended once all of them are final.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", defer_build=True)  # built on first use (see agent._Spec)


class Usage(_Model):
    """Token counts and cost of model calls (summed over a session in its header)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    cost: float | None = None

    def __add__(self, other: Usage) -> Usage:
        cost = None if self.cost is None and other.cost is None else (self.cost or 0.0) + (other.cost or 0.0)
        return Usage(
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            completion_tokens=self.completion_tokens + other.completion_tokens,
            total_tokens=self.total_tokens + other.total_tokens,
            reasoning_tokens=self.reasoning_tokens + other.reasoning_tokens,
            cached_tokens=self.cached_tokens + other.cached_tokens,
            cost=cost,
        )


class Media(_Model):
    """An attachment: an image or other file, base64-encoded."""

    mime_type: str
    data_base64: str
    filename: str | None = None


class UserQuery(_Model):
    """What the user asked: text and media parts, in the order given."""

    text: str = ""
    media: list[Media] = Field(default_factory=list)


class ToolCall(_Model):
    """One call the model asked for (OpenAI shape): `arguments` is the JSON text the model sent."""

    id: str
    name: str
    arguments: str = "{}"


class ToolResponse(_Model):
    """The answer to one call as the model gets it: `content` is text or a JSON value."""

    call_id: str
    tool: str
    content: Any = None
    is_error: bool = False
    media: list[Media] = Field(default_factory=list)


class UserTurn(_Model):
    kind: Literal["UserTurn"] = "UserTurn"
    query: UserQuery | None = None
    tool_responses: list[ToolResponse] = Field(default_factory=list)
    at: float = 0.0


class LlmTurn(_Model):
    kind: Literal["LlmTurn"] = "LlmTurn"
    text: str | None = None
    #: reasoning/thinking text, kept apart from the answer
    reasoning: str | None = None
    #: provider thinking blocks, verbatim: some providers require them back with tool results
    thinking_blocks: list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    usage: Usage = Field(default_factory=Usage)
    model: str = ""
    finish_reason: str | None = None
    at: float = 0.0
    duration_ms: float | None = None


StoredTurn = Annotated[UserTurn | LlmTurn, Field(discriminator="kind")]
