"""The offline model `test/tools`: calls every tool it is offered once, then answers with the results.

For testing agent files without a network: each tool the agent offers (its own, its MCP servers',
its sub-agents' `prompt_agent_<slug>`) is called once, in the order offered, with arguments built
from the tool's `parameters` JSON Schema (`example_arguments`): a default or `const` when the
schema gives one, the first of an `enum` or of `examples`, else a value of the type within its
bounds; objects get their required properties and those with defaults, arrays `minItems` items (at
least one). Once the results are in, it answers with each of them folded into its text. With no
tools, or asked again after its answer, it says what it got. Deterministic, no network, served
through litellm like any other model; streamed, its answer comes in pieces of a few words
(llm/offline.py `live_parts`).
"""

from __future__ import annotations

import json
from typing import Any, TypeGuard

PROVIDER = "test"
#: the longest piece of a result the answer quotes
_RESULT_CHARS = 500
#: how deep nested schemas are followed (deeper ones get null)
_MAX_DEPTH = 12

_STRING_FORMATS = {
    "date-time": "2026-01-01T12:00:00Z",
    "date": "2026-01-01",
    "time": "12:00:00",
    "email": "test@example.com",
    "uri": "https://example.com/",
    "url": "https://example.com/",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "hostname": "example.com",
    "ipv4": "192.0.2.1",
    "ipv6": "2001:db8::1",
}


def example_arguments(schema: dict[str, Any]) -> dict[str, Any]:
    """Deterministic arguments valid under a tool's `parameters` schema (an object)."""
    value = _example(schema, schema, "value", 0)
    return value if isinstance(value, dict) else {}


def _resolve(schema: Any, root: dict[str, Any]) -> Any:
    """A local `$ref` (`#/$defs/...`, `#/definitions/...`) resolved against the root schema."""
    seen = 0
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and seen < _MAX_DEPTH:
        ref = schema["$ref"]
        if not ref.startswith("#/"):
            return {}
        target: Any = root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, dict) else None
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        schema = {**target, **rest} if isinstance(target, dict) else rest
        seen += 1
    return schema


def _example(schema: Any, root: dict[str, Any], name: str, depth: int) -> Any:
    schema = _resolve(schema, root)
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return None
    for given in ("const", "default"):
        if given in schema:
            return schema[given]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    if isinstance(schema.get("examples"), list) and schema["examples"]:
        return schema["examples"][0]
    for choice in ("oneOf", "anyOf"):
        options = schema.get(choice)
        if isinstance(options, list) and options:
            rest = {k: v for k, v in schema.items() if k != choice}
            return _example({**rest, **_resolve(options[0], root)}, root, name, depth + 1)
    if isinstance(schema.get("allOf"), list):
        merged = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            part = _resolve(part, root)
            if isinstance(part, dict):
                props = {**merged.get("properties", {}), **part.get("properties", {})}
                required = [*merged.get("required", []), *part.get("required", [])]
                merged = {**merged, **part, "properties": props, "required": required}
        return _example(merged, root, name, depth + 1)
    kind = _type_of(schema)
    if kind == "object":
        return _object(schema, root, depth)
    if kind == "array":
        return _array(schema, root, name, depth)
    if kind == "string":
        return _string(schema, name)
    if kind in ("integer", "number"):
        return _number(schema, kind)
    if kind == "boolean":
        return True
    return None


def _type_of(schema: dict[str, Any]) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if kinds else "null"
    if isinstance(kind, str):
        return kind
    if "properties" in schema:
        return "object"
    if "items" in schema:
        return "array"
    return "string"


def _object(schema: dict[str, Any], root: dict[str, Any], depth: int) -> dict[str, Any]:
    given = schema.get("properties")
    props: dict[str, Any] = given if isinstance(given, dict) else {}
    required = [r for r in schema.get("required", []) if isinstance(r, str)]
    out: dict[str, Any] = {}
    for key, sub in props.items():
        sub = _resolve(sub, root)
        if key in required or (isinstance(sub, dict) and "default" in sub):
            out[key] = _example(sub, root, key, depth + 1)
    for key in required:  # required but not described: any string will do
        out.setdefault(key, key)
    return out


def _array(schema: dict[str, Any], root: dict[str, Any], name: str, depth: int) -> list[Any]:
    items = schema.get("items")
    if isinstance(schema.get("prefixItems"), list):
        return [_example(s, root, name, depth + 1) for s in schema["prefixItems"]]
    count = max(1, int(schema.get("minItems", 1) or 1))
    maximum = schema.get("maxItems")
    if isinstance(maximum, int):
        count = min(count, maximum)
    first = _example(items if items is not None else {}, root, name, depth + 1)
    if schema.get("uniqueItems") and count > 1:
        if isinstance(first, str):
            return [first if i == 0 else f"{first}{i + 1}" for i in range(count)]
        if isinstance(first, (int, float)) and not isinstance(first, bool):
            return [first + i for i in range(count)]
    return [first for _ in range(count)]


def _string(schema: dict[str, Any], name: str) -> str:
    fmt = schema.get("format")
    text = _STRING_FORMATS.get(fmt, f"test {name}") if isinstance(fmt, str) else f"test {name}"
    low = int(schema.get("minLength", 0) or 0)
    high = schema.get("maxLength")
    if len(text) < low:
        text = text + "x" * (low - len(text))
    if isinstance(high, int) and len(text) > high:
        text = text[:high]
    return text


def _number(schema: dict[str, Any], kind: str) -> int | float:
    """1, or the nearest value the bounds allow (a multiple of `multipleOf` where it asks)."""
    low, high = schema.get("minimum"), schema.get("maximum")
    xlow, xhigh = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    gap = 1 if kind == "integer" else 0.5
    value: float = 1
    if _is_number(low):
        value = max(value, low)
    if _is_number(xlow) and value <= xlow:
        value = xlow + gap
    if _is_number(high):
        value = min(value, high)
    if _is_number(xhigh) and value >= xhigh:
        value = (xlow + xhigh) / 2 if kind != "integer" and _is_number(xlow) else xhigh - gap
    step = schema.get("multipleOf")
    if _is_number(step) and step > 0:
        value = step * max(1, -(-value // step))
    return int(value) if kind == "integer" else value


def _is_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool results that end the conversation, in call order."""
    tail = []
    for m in reversed(messages):
        if m.get("role") != "tool":
            break
        tail.append(m)
    return list(reversed(tail))


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return json.dumps(content, ensure_ascii=False)


def tools_reply(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The `test/tools` model's answer to a conversation: text, reasoning, tool calls, usage."""
    offered = [t["function"] for t in tools or [] if t.get("type") == "function" and t.get("function")]
    turn_no = sum(1 for m in messages if m.get("role") == "assistant")
    last = messages[-1] if messages else {"role": "user", "content": ""}
    prompt_tokens = sum(len(json.dumps(m)) for m in messages) // 4
    if last.get("role") == "tool":
        names = {}
        for m in reversed(messages):
            if m.get("role") == "assistant":
                names = {c["id"]: c["function"]["name"] for c in m.get("tool_calls") or []}
                break
        lines = [
            f"{names.get(str(m.get('tool_call_id')), 'a tool')} returned {_text_of(m.get('content'))[:_RESULT_CHARS]}"
            for m in _results(messages)
        ]
        text = f"I called {len(lines)} tool{'' if len(lines) == 1 else 's'}. " + " ".join(
            f"{line.rstrip('.')}." for line in lines
        )
        return {"content": text, "reasoning": None, "tool_calls": [], "usage": (prompt_tokens, len(text) // 4 + 1)}
    if offered and turn_no == 0:
        calls = [
            {
                "id": f"call_{turn_no}_{i}",
                "name": fn["name"],
                "arguments": json.dumps(example_arguments(fn.get("parameters") or {}), ensure_ascii=False),
            }
            for i, fn in enumerate(offered)
        ]
        reasoning = "I call every tool I was given once: " + ", ".join(c["name"] for c in calls) + "."
        return {"content": None, "reasoning": reasoning, "tool_calls": calls, "usage": (prompt_tokens, 12 * len(calls))}
    said = _text_of(last.get("content")).strip()[:500]
    done = "I called the tools already" if offered else "I have no tools to call"
    text = f"(offline test model) {done}. You said: {said}"
    return {"content": text, "reasoning": None, "tool_calls": [], "usage": (prompt_tokens, len(text) // 4 + 1)}
