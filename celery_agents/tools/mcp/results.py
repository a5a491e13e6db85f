"""An MCP `CallToolResult` (as JSON) as the call's outcome.

`isError` makes a failed call whose error is the result's text. Otherwise the structured result
(`structuredContent`) is the result when there is one, else the text parts joined; images and
audio go to the call's media (the model sees them), embedded text resources count as text, and
other parts are kept as they came.
"""

from __future__ import annotations

import json
from typing import Any

from celery_agents.model import CallMeta, CallOutcome
from celery_agents.tools.output import cut, split_media


def _text_of(part: Any) -> str | None:
    if not isinstance(part, dict):
        return None
    if part.get("type") == "text" and isinstance(part.get("text"), str):
        return str(part["text"])
    resource = part.get("resource")
    if part.get("type") == "resource" and isinstance(resource, dict) and isinstance(resource.get("text"), str):
        return str(resource["text"])
    return None


def outcome_of_result(raw: dict[str, Any], cap: int, duration_ms: float | None = None) -> CallOutcome:
    found = raw.get("content")
    content: list[Any] = found if isinstance(found, list) else []
    texts = [t for t in (_text_of(p) for p in content) if t is not None]
    if raw.get("isError"):
        error = "\n".join(texts) or (json.dumps(content)[:2000] if content else "the MCP tool reported an error")
        return CallOutcome(state="failed", error=error, duration_ms=duration_ms)
    rest, media = split_media(content) if content else ([], [])
    result: Any
    if raw.get("structuredContent") is not None:
        result = raw["structuredContent"]
    elif media:
        result = rest
    elif len(texts) == len(content):
        result = "\n".join(texts)
    else:
        result = content
    result, size = cut(result, cap)
    meta = CallMeta(output_capped={"written": size, "cap": cap}) if size is not None else CallMeta()
    return CallOutcome(state="completed", result=result, media=media, duration_ms=duration_ms, meta=meta)
