"""Fleet-wide limits on model calls (`agents limits set KEY ...`) and session priority.

A limit is held under a KEY: a model name as agent files write it (`openai/gpt-4o-mini`), or a
`limitKey` agent files name (a tenant, a team). A model call is admitted only when every limit that
applies to it has room: its model's and its agent's `limitKey`'s. What a call counts against a
tokens-per-minute limit before it is made is `estimate_tokens`; the usage it reports corrects it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: the shape of a KEY (a model name or a `limitKey`): what Redis keys, metric labels and
#: command lines carry without quoting
LIMIT_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+=~-]{0,199}$")
LIMIT_KEY_RULE = "1-200 letters, digits or . _ : / @ + = ~ -, starting with a letter or digit"

#: a session's priority: 0 (lowest) to 9 (highest); sessions whose agent file names none take 5
PRIORITY_MIN, PRIORITY_MAX, DEFAULT_PRIORITY = 0, 9, 5

#: what a call's answer is counted as before it is made when the agent's `modelParams` set no
#: `max_tokens` (or `max_completion_tokens`): the usage it reports corrects the count
COMPLETION_ESTIMATE = 256
#: characters of a request's JSON per estimated prompt token (what tokenizers of English average)
CHARS_PER_TOKEN = 4

#: the kinds of a limit, as `limits set` names them
LimitKind = Literal["rpm", "tpm", "concurrency"]
LIMIT_KINDS: tuple[LimitKind, ...] = ("rpm", "tpm", "concurrency")


def check_limit_key(key: str) -> str:
    """`key` if it is a usable KEY, else ValueError naming the rule."""
    if not LIMIT_KEY.match(key):
        raise ValueError(f"a limit KEY is {LIMIT_KEY_RULE}; got {key[:80]!r}")
    return key


class ModelLimit(BaseModel):
    """The limits of one KEY; a kind left out is not limited. Each is at least 1: a limit of 0
    would stop every call for good (delete the limit, or pause the session, instead)."""

    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)  # built on first use

    #: model calls started per minute
    rpm: int | None = Field(default=None, ge=1, le=10_000_000)
    #: tokens per minute: estimated before each call, corrected by its usage
    tpm: int | None = Field(default=None, ge=1, le=10_000_000_000)
    #: model calls in flight at once
    concurrency: int | None = Field(default=None, ge=1, le=1_000_000)

    @property
    def empty(self) -> bool:
        return self.rpm is None and self.tpm is None and self.concurrency is None

    def to_json(self) -> str:
        return self.model_dump_json(exclude_none=True)


@dataclass(frozen=True)
class LimitUsage:
    """One KEY's limits and what the fleet does under them now (doctor, metrics, `limits list`)."""

    key: str
    limit: ModelLimit
    #: model calls admitted and tokens counted in the current minute and the one before it
    #: (Redis's clock, whole minutes)
    requests_this_minute: int = 0
    tokens_this_minute: int = 0
    requests_last_minute: int = 0
    tokens_last_minute: int = 0
    #: calls holding a slot now (only counted under a concurrency limit)
    in_flight: int = 0
    #: steps waiting for a slot of the concurrency limit
    waiting: int = 0
    #: seconds until a call asking now could start by the rate limits (0: at once)
    booked_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            **self.limit.model_dump(),
            "usage": {
                "requests_this_minute": self.requests_this_minute,
                "tokens_this_minute": self.tokens_this_minute,
                "requests_last_minute": self.requests_last_minute,
                "tokens_last_minute": self.tokens_last_minute,
                "in_flight": self.in_flight,
                "waiting": self.waiting,
                "booked_seconds": round(self.booked_seconds, 3),
            },
        }


@dataclass(frozen=True)
class Pause:
    """A model paused for the whole fleet by a provider's 429 with Retry-After, until `until`
    (seconds, Redis's clock)."""

    model: str
    until: float


def estimate_tokens(messages: Sequence[Any], tools: Sequence[Any], model_params: dict[str, Any]) -> int:
    """What a call counts against a tokens-per-minute limit before it is made: a token per
    `CHARS_PER_TOKEN` characters of its messages and tools as JSON (media count by their encoded
    size), plus the answer's bound, `max_tokens` (or `max_completion_tokens`) of `modelParams`, else
    `COMPLETION_ESTIMATE`. Providers that count a request before running it count it much the same
    way (the request's size plus its `max_tokens`)."""
    size = len(json.dumps([list(messages), list(tools)], ensure_ascii=False, default=str))
    answer = model_params.get("max_tokens") or model_params.get("max_completion_tokens")
    bound = int(answer) if isinstance(answer, int | float) and answer > 0 else COMPLETION_ESTIMATE
    return math.ceil(size / CHARS_PER_TOKEN) + bound


def limits_json(usages: Iterable[LimitUsage], pauses: Iterable[Pause]) -> dict[str, Any]:
    """`limits list --json`: every limit with its usage, and the models paused now."""
    return {
        "limits": [u.to_json() for u in usages],
        "paused": [{"model": p.model, "until": p.until} for p in pauses],
    }
