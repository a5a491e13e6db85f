"""The session header as its Redis hash (`keys.meta`), derived from `SessionHeader`'s fields.

Every field is one hash field of the same name, as text: a model value (usage, error) as its
JSON with defaults left out, a string that may be None (`response`) as JSON so that "" and None
stay apart, None as "", anything else as `str`. Reading applies the same rule backwards; a field
missing from the hash (no script wrote it yet) reads as its default, or None where
it may be None. `error_code` is stored beside `error` so that scripts can test it without JSON.
Adding a field to `SessionHeader` needs nothing here. `spent` is the exception: flat fields
(`budget.SPENT_FIELDS`) that scripts add to, read into it and never written from it.

`usage` is stored as a JSON array (`[prompt, completion, total, reasoning, cached, cost]`, trailing
defaults left out), not as its object: Redis keeps a hash compact (a listpack, a third of a
hashtable's memory) only while every value is at most `hash-max-listpack-value` (64) bytes, and
the object's field names alone pass that.

The fields of `SPARSE` are left out of the hash while they hold their default (`header_to_stored`,
`sparse_update`): most sessions keep them so for good (no parent, no budget, no error...), and
each costs its name and value in every header. Every script that reads one of them takes it absent
as its default (`priority` as 5, `inbox_waiting` as 0, the others as none).
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass
from enum import Enum
from typing import Any

from pydantic import BaseModel

from celery_agents.model import SessionHeader, Usage
from celery_agents.model.budget import spend_from_fields

#: stored as JSON although not a model: the empty string is a value of theirs, distinct from None
_JSON_TEXT = frozenset({"response", "grants", "ancestors", "bounded_by"})
#: read from the flat fields the scripts add to (`budget.SPENT_FIELDS`), never written whole
_SPENT = "spent"
#: not a field of the model: the error's code, for scripts (`_lib.lua` `reactivate`)
ERROR_CODE = "error_code"


@dataclass(frozen=True)
class _Field:
    name: str
    model: type[BaseModel] | None
    nullable: bool
    required: bool


def _model_type(annotation: Any) -> type[BaseModel] | None:
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _nullable(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    return origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(annotation)


_FIELDS = tuple(
    _Field(name, _model_type(info.annotation), _nullable(info.annotation), info.is_required())
    for name, info in SessionHeader.model_fields.items()
    if name != _SPENT
)


#: `Usage`'s fields in the order of its stored array
_USAGE = ("prompt_tokens", "completion_tokens", "total_tokens", "reasoning_tokens", "cached_tokens", "cost")


def usage_text(usage: Usage) -> str:
    """`usage` as the header stores it: a JSON array of its fields, trailing defaults left out."""
    values: list[Any] = [getattr(usage, name) for name in _USAGE]
    # The cost comes last: None (unpriced) is its default, 0.0 a price; the counts' default is 0.
    while values and (values[-1] is None or (len(values) < len(_USAGE) and values[-1] == 0)):
        values.pop()
    return json.dumps(values, separators=(",", ":"))


def usage_from_text(raw: str) -> Usage:
    return Usage(**dict(zip(_USAGE, json.loads(raw), strict=False)))


def _text(f: _Field, value: Any) -> str:
    if f.name == "usage" and isinstance(value, Usage):
        return usage_text(value)
    if f.name in _JSON_TEXT:
        return json.dumps(value)
    if value is None:
        return ""
    if isinstance(value, BaseModel):
        return value.model_dump_json(exclude_defaults=True)
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _value(f: _Field, raw: str) -> Any:
    if f.name == "usage":
        return usage_from_text(raw)
    if f.name in _JSON_TEXT:
        return json.loads(raw)
    if f.model is not None:
        return f.model.model_validate_json(raw)
    return raw


#: left out of the hash while at their default (read back as it)
SPARSE = frozenset(
    {
        "execution_mode",
        "usage",
        "error",
        ERROR_CODE,
        "response",
        "inbox_waiting",
        "parent",
        "parent_call",
        "grants",
        "budget",
        "ancestors",
        "bounded_by",
        "forked_from",
        "forked_at",
        "replays",
        "priority",
        "throttled_until",
    }
)


def _default_text(f: _Field) -> str:
    info = SessionHeader.model_fields[f.name]
    return _text(f, info.get_default(call_default_factory=True))


_DEFAULT_TEXT = {f.name: _default_text(f) for f in _FIELDS if f.name in SPARSE} | {ERROR_CODE: ""}


def header_to_hash(h: SessionHeader) -> dict[str, str]:
    """Every field of `h` as the text its hash field holds, and the error's code."""
    stored = {f.name: _text(f, getattr(h, f.name)) for f in _FIELDS}
    stored[ERROR_CODE] = h.error.code if h.error else ""
    return stored


_BY_NAME = {f.name: f for f in _FIELDS}


def header_texts(h: SessionHeader, names: tuple[str, ...]) -> dict[str, str]:
    """The texts `header_to_hash` gives the fields `names` of `h` (a step's commit writes a few)."""
    return {
        name: (h.error.code if h.error else "") if name == ERROR_CODE else _text(_BY_NAME[name], getattr(h, name))
        for name in names
    }


def header_to_stored(h: SessionHeader) -> dict[str, str]:
    """The hash a session is written as when it is made: `header_to_hash` without the fields of
    `SPARSE` at their default, nor the session's id (its key names it: `header_from_hash` takes
    it from the caller)."""
    stored = header_to_hash(h)
    del stored["session_id"]
    return {name: text for name, text in stored.items() if _DEFAULT_TEXT.get(name) != text}


def sparse_update(before: dict[str, str], after: dict[str, str]) -> dict[str, str]:
    """The fields of `after` to write over a hash that holds `before` (both `header_to_hash`
    texts): all but those of `SPARSE` at their default in both (absent, they stay so)."""
    return {
        name: text
        for name, text in after.items()
        if name not in _DEFAULT_TEXT or text != _DEFAULT_TEXT[name] or before.get(name, text) != text
    }


def header_from_hash(d: dict[str, str], session_id: str = "") -> SessionHeader:
    """The header a hash holds, of the session `session_id` (the hash of a session made by an
    earlier release names it too); fields it lacks take their defaults (None where they may be None)."""
    if session_id:
        d = {**d, "session_id": session_id}
    values: dict[str, Any] = {}
    for f in _FIELDS:
        raw = d.get(f.name, "")
        if raw:
            values[f.name] = _value(f, raw)
        elif f.nullable:
            values[f.name] = None
        elif f.required:
            values[f.name] = ""
    values[_SPENT] = spend_from_fields(d)
    return SessionHeader.model_validate(values)
