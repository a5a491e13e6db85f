"""Checking the arguments the model sent against the tool's JSON Schema.

A mismatch never reaches the tool: it becomes a failed call whose text names each problem and the
arguments the tool expects, so the model can correct itself on its next turn.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from jsonschema import Draft202012Validator


@lru_cache(maxsize=256)
def _validator(schema_json: str) -> Draft202012Validator:
    return Draft202012Validator(json.loads(schema_json))


def expected_arguments(schema: dict[str, Any]) -> str:
    """`city (string, required), days (integer)`: the arguments a schema asks for, in one line."""
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    parts = []
    for name, prop in props.items():
        kind = prop.get("type", "any") if isinstance(prop, dict) else "any"
        if isinstance(kind, list):
            kind = " or ".join(str(k) for k in kind)
        if isinstance(prop, dict) and "enum" in prop:
            kind = "one of " + ", ".join(json.dumps(v) for v in prop["enum"])
        parts.append(f"{name} ({kind}{', required' if name in required else ''})")
    return ", ".join(parts) or "no arguments"


def argument_problems(tool: str, schema: dict[str, Any], arguments: Any) -> str | None:
    """None when `arguments` fit `schema`; else the message the model gets."""
    validator = _validator(json.dumps(schema, sort_keys=True))
    errors = sorted(validator.iter_errors(arguments), key=lambda e: (list(e.absolute_path), e.message))
    if not errors:
        return None
    lines = []
    for err in errors[:10]:
        where = "/".join(str(p) for p in err.absolute_path)
        lines.append(f"- {where + ': ' if where else ''}{err.message}")
    if len(errors) > 10:
        lines.append(f"- … and {len(errors) - 10} more")
    return (
        f"invalid arguments for {tool}:\n"
        + "\n".join(lines)
        + f"\nExpected a JSON object with: {expected_arguments(schema)}. "
        f"Call {tool} again with corrected arguments."
    )
