"""What a tool answered, as the result the model gets: JSON or text, media split off, cut to size.

Output is a JSON value when it parses as one, else stripped text. An image comes back as
`{"type": "image", "mimeType": ..., "base64Data": ...}` (or `data` for the payload), alone, in a
list of content parts (MCP style, with `{"type": "text", "text": ...}` parts), or as an MCP tool
result `{"content": [...]}`; images go to the call's media and the text parts stay the result.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from celery_agents.model import CallMeta, CallOutcome, Media
from celery_agents.model.limits import UnusableJson, load_json


def parse_output(text: str) -> Any:
    """Tool output: a JSON value when it parses as one, else the stripped text."""
    stripped = text.strip()
    if stripped[:1] in '{["' or stripped in ("true", "false", "null") or _is_number(stripped):
        try:
            return load_json(stripped)
        except (json.JSONDecodeError, UnusableJson):
            pass  # not JSON, or JSON too deep to carry: the text itself is the result
    return stripped


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _media_of(part: Any) -> Media | None:
    if not isinstance(part, dict) or part.get("type") not in ("image", "audio", "media", "file"):
        return None
    mime = part.get("mimeType") or part.get("mime_type") or part.get("media_type")
    data = part.get("base64Data") or part.get("data") or part.get("data_base64")
    if not isinstance(mime, str) or not isinstance(data, str) or "/" not in mime:
        return None
    try:
        base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return None
    name = part.get("filename") or part.get("name")
    return Media(mime_type=mime, data_base64=data, filename=name if isinstance(name, str) else None)


def split_media(value: Any) -> tuple[Any, list[Media]]:
    """(result, media): images taken out of a tool's answer; the answer itself when it has none."""
    parts: list[Any] | None = None
    if (
        isinstance(value, dict)
        and isinstance(value.get("content"), list)
        and set(value) <= {"content", "isError", "structuredContent", "_meta"}
    ):
        parts = value["content"]
    elif isinstance(value, list) and value and all(isinstance(p, dict) and "type" in p for p in value):
        parts = value
    elif _media_of(value) is not None:
        parts = [value]
    if parts is None:
        return value, []
    media = [m for m in (_media_of(p) for p in parts) if m is not None]
    if not media:
        return value, []
    rest = [p for p in parts if _media_of(p) is None]
    texts = [
        p["text"] for p in rest if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
    ]
    if len(texts) == len(rest):
        described = ", ".join(f"{m.mime_type} ({len(m.data_base64) * 3 // 4} bytes)" for m in media)
        result: Any = "\n".join(texts) if texts else f"attached: {described}"
    else:
        result = rest
    return result, media


def media_from_bytes(data: bytes, mime_type: str) -> Media:
    """A file a tool printed on stdout (already base64 when it decodes strictly as such)."""
    stripped = data.strip()
    try:
        if stripped:
            base64.b64decode(stripped, validate=True)
            return Media(mime_type=mime_type, data_base64=stripped.decode("ascii"))
    except (binascii.Error, ValueError):
        pass
    return Media(mime_type=mime_type, data_base64=base64.b64encode(data).decode("ascii"))


def cut(value: Any, limit: int) -> tuple[Any, int | None]:
    """(value, None) when its text fits in `limit` bytes; else (text cut at `limit` bytes with a
    note saying so, original size). A JSON value that is cut becomes text."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    data = text.encode()
    if len(data) <= limit:
        return value, None
    kept = data[:limit].decode(errors="ignore")
    return f"{kept}\n[truncated: the result was {len(data)} bytes, cut to {limit}]", len(data)


def capped_note(written: int, cap: int) -> str:
    return f"\n[output cut: the tool wrote {written} bytes; only the first {cap} are kept (limits.outputBytes)]"


def bound_outcome(outcome: CallOutcome, max_bytes: int) -> CallOutcome:
    """A tool's outcome as it may be stored and sent to the model: a result (with its media) over
    `max_bytes` is cut to text of that size saying so, media that do not fit are dropped, and an
    error text is cut too. Whatever a tool's own limits allow, AGENTS_MAX_RESULT_BYTES holds."""
    if outcome.error is not None and len(outcome.error.encode()) > max_bytes:
        outcome.error = outcome.error.encode()[:max_bytes].decode(errors="ignore") + "\n[error text cut]"
    if outcome.result is None and not outcome.media:
        return outcome
    text = outcome.result if isinstance(outcome.result, str) else json.dumps(outcome.result, ensure_ascii=False)
    size = len(text.encode()) + sum(len(m.data_base64) for m in outcome.media)
    if size <= max_bytes:
        return outcome
    kept = text.encode()[:max_bytes].decode(errors="ignore")
    dropped = f", {len(outcome.media)} attachment(s) dropped" if outcome.media else ""
    outcome.result = (
        f"{kept}\n[cut: the result was {size} bytes, more than AGENTS_MAX_RESULT_BYTES ({max_bytes}){dropped}]"
    )
    outcome.media = []
    outcome.meta |= CallMeta(result_capped={"size": size, "cap": max_bytes})
    return outcome
