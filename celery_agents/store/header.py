"""The session header as its Redis hash (`keys.meta`), derived from `SessionHeader`'s fields.

Every field is one hash field of the same name, as text: a model value (usage, error) as its
JSON with defaults left out, a string that may be None (`response`) as JSON so that "" and None
stay apart, None as "", anything else as `str`. Reading applies the same rule backwards; a field
missing from the hash (a session stored by an older release) reads as its default, or None where
it may be None. `error_code` is stored beside `error` so that scripts can test it without JSON.
Adding a field to `SessionHeader` needs nothing here.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass
from enum import Enum
from typing import Any

from pydantic import BaseModel

from celery_agents.model import SessionHeader

#: stored as JSON although not a model: the empty string is a value of theirs, distinct from None
_JSON_TEXT = frozenset({"response"})
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
)


def _text(f: _Field, value: Any) -> str:
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
    if f.name in _JSON_TEXT:
        return json.loads(raw)
    if f.model is not None:
        return f.model.model_validate_json(raw)
    return raw


def header_to_hash(h: SessionHeader) -> dict[str, str]:
    """Every field of `h` as the text its hash field holds, and the error's code."""
    stored = {f.name: _text(f, getattr(h, f.name)) for f in _FIELDS}
    stored[ERROR_CODE] = h.error.code if h.error else ""
    return stored


def header_from_hash(d: dict[str, str]) -> SessionHeader:
    """The header a hash holds; fields it lacks take their defaults (None where they may be None)."""
    values: dict[str, Any] = {}
    for f in _FIELDS:
        raw = d.get(f.name, "")
        if raw:
            values[f.name] = _value(f, raw)
        elif f.nullable:
            values[f.name] = None
        elif f.required:
            values[f.name] = ""
    return SessionHeader.model_validate(values)
