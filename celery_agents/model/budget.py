"""Budgets: what a session tree may spend (the agent file's `budget`) and what it has spent.

Both use the contract's names on the wire (`tokens`, `costUsd`, `modelCalls`, `toolCalls`). A
session's `Spend` counts its own model and tool calls and those of every session below it. An
agent file's `Pricing` (its `pricing`) prices its model calls where litellm's price list would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from celery_agents.model.turns import Usage

#: a limit of a budget, as the agent file and `--grant` name it
BudgetKind = Literal["tokens", "costUsd", "modelCalls", "toolCalls"]
BUDGET_KINDS: tuple[BudgetKind, ...] = ("tokens", "costUsd", "modelCalls", "toolCalls")
#: the limits checked before a model call (a tool call spends no tokens)
MODEL_KINDS: tuple[BudgetKind, ...] = ("tokens", "costUsd", "modelCalls")
TOOL_KINDS: tuple[BudgetKind, ...] = ("toolCalls",)


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid", populate_by_name=True, serialize_by_alias=True, frozen=True, defer_build=True
    )


#: the largest count a limit (or a grant) may be: Redis's scripts add limits as Lua numbers
#: (doubles) and write them back as JSON with 14 significant digits, so a count beyond that would
#: come back changed, or in a form no integer parser reads (set_drive.lua keeps a sum within it)
MAX_COUNT_LIMIT = 10**13
#: the largest `costUsd` limit (or grant)
MAX_COST_LIMIT = 1e9


class Budget(_Model):
    """Limits of a session together with all its sub-agents; a limit left out is no limit."""

    tokens: int | None = Field(default=None, ge=0, le=MAX_COUNT_LIMIT)
    cost_usd: float | None = Field(default=None, alias="costUsd", ge=0, le=MAX_COST_LIMIT, allow_inf_nan=False)
    model_calls: int | None = Field(default=None, alias="modelCalls", ge=0, le=MAX_COUNT_LIMIT)
    tool_calls: int | None = Field(default=None, alias="toolCalls", ge=0, le=MAX_COUNT_LIMIT)

    def limit(self, kind: BudgetKind) -> float | None:
        value: float | None = getattr(self, _ATTR[kind])
        return value


class Spend(_Model):
    """What a session and the sessions below it have spent."""

    tokens: int = 0
    cost_usd: float = Field(default=0.0, alias="costUsd")
    model_calls: int = Field(default=0, alias="modelCalls")
    tool_calls: int = Field(default=0, alias="toolCalls")

    def amount(self, kind: BudgetKind) -> float:
        value: float = getattr(self, _ATTR[kind])
        return value

    def __add__(self, other: Spend) -> Spend:
        return Spend(
            tokens=self.tokens + other.tokens,
            cost_usd=self.cost_usd + other.cost_usd,
            model_calls=self.model_calls + other.model_calls,
            tool_calls=self.tool_calls + other.tool_calls,
        )

    @property
    def nothing(self) -> bool:
        return not (self.tokens or self.cost_usd or self.model_calls or self.tool_calls)


#: the highest price per million tokens a file may give (no model costs this much; a typo might)
MAX_PRICE_PER_MTOK = 100_000.0


class Pricing(_Model):
    """What the agent's model calls cost, in US dollars per million tokens, as providers quote it:
    `inputPerMTokUsd` for the prompt's tokens (cached ones included), `outputPerMTokUsd` for the
    completion's (reasoning included). Given, it prices every model call of the agent (its
    `fallbackModels`' too) instead of litellm's price list: a gateway, a private deployment, a
    negotiated rate."""

    input_per_mtok_usd: float = Field(alias="inputPerMTokUsd", ge=0, le=MAX_PRICE_PER_MTOK, allow_inf_nan=False)
    output_per_mtok_usd: float = Field(alias="outputPerMTokUsd", ge=0, le=MAX_PRICE_PER_MTOK, allow_inf_nan=False)

    def cost(self, usage: Usage) -> float:
        """The price of a call that used `usage`: its prompt and completion tokens at their rates."""
        prompt = usage.prompt_tokens * self.input_per_mtok_usd
        return (prompt + usage.completion_tokens * self.output_per_mtok_usd) / 1e6

    def priced(self, usage: Usage) -> Usage:
        """`usage` with its cost at these prices."""
        return usage.model_copy(update={"cost": self.cost(usage)})


@dataclass(frozen=True)
class BudgetScope:
    """One session's limits and what it (with the sessions below it) has spent: what the budget
    check (scheduler/budget.py) reads for the session and for each session above it."""

    session_id: str
    budget: Budget
    spent: Spend


#: each kind's attribute
_ATTR: dict[BudgetKind, str] = {
    "tokens": "tokens",
    "costUsd": "cost_usd",
    "modelCalls": "model_calls",
    "toolCalls": "tool_calls",
}
#: the header hash fields holding a session's spend, incremented by the scripts that spend
#: (`_lib.lua` `add_spend`): flat fields, so that a script adds to them without reading JSON
SPENT_FIELDS: dict[BudgetKind, str] = {
    "tokens": "spent_tokens",
    "costUsd": "spent_cost",
    "modelCalls": "spent_model_calls",
    "toolCalls": "spent_tool_calls",
}


def spend_from_fields(fields: dict[str, str]) -> Spend:
    """The spend the header hash's `SPENT_FIELDS` hold (absent: nothing spent)."""
    raw = {_ATTR[k]: fields.get(f) or "0" for k, f in SPENT_FIELDS.items()}
    return Spend(
        tokens=int(float(raw["tokens"])),
        cost_usd=float(raw["cost_usd"]),
        model_calls=int(float(raw["model_calls"])),
        tool_calls=int(float(raw["tool_calls"])),
    )


def parse_grant(text: str) -> Budget:
    """`tokens=N,costUsd=X,modelCalls=N,toolCalls=N` (any of them) as the limits to add."""
    values: dict[str, str] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in BUDGET_KINDS:
            raise ValueError(
                f"--grant takes kind=amount pairs separated by commas, kinds {', '.join(BUDGET_KINDS)}; got {part!r}"
            )
        values[name] = value.strip()
    if not values:
        raise ValueError("--grant names nothing to raise: give e.g. modelCalls=5")
    try:
        return Budget.model_validate(values)
    except ValidationError as exc:  # said as the option was written, not as pydantic's report
        first = exc.errors()[0]
        name = str(first["loc"][0]) if first.get("loc") else "?"
        shown = values.get(name, "")
        raise ValueError(f"{name}={shown!r}: {first['msg'].lower()}") from None
