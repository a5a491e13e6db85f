"""Building the OpenAI-shaped message list a model call sends, from the session's turns."""

from __future__ import annotations

import json
from typing import Any

from celery_agents.model import AgentSpec, LlmTurn, Media, ToolResponse, UserQuery, UserTurn


def tool_content(response: ToolResponse) -> str:
    """The text a tool message carries: strings as they are, JSON values encoded."""
    content = response.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        text = json.dumps(content, ensure_ascii=False)
    if response.is_error and not text.startswith("Error"):
        text = f"Error: {text}"
    return text


def media_part(m: Media) -> dict[str, Any]:
    """An attachment as a content part: images as `image_url`, other files as `file`."""
    data = f"data:{m.mime_type};base64,{m.data_base64}"
    if m.mime_type.startswith("image/"):
        return {"type": "image_url", "image_url": {"url": data}}
    return {"type": "file", "file": {"file_data": data, "filename": m.filename}}


def _query_message(query: UserQuery) -> dict[str, Any]:
    if not query.media:
        return {"role": "user", "content": query.text}
    parts: list[dict[str, Any]] = []
    if query.text:
        parts.append({"type": "text", "text": query.text})
    parts.extend(media_part(m) for m in query.media)
    return {"role": "user", "content": parts}


def _assistant_message(turn: LlmTurn) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": turn.text}
    if turn.tool_calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in turn.tool_calls
        ]
    if turn.thinking_blocks:
        # Sent back verbatim: providers with extended thinking refuse tool results without them.
        msg["thinking_blocks"] = turn.thinking_blocks
    if turn.reasoning and not turn.thinking_blocks:
        msg["reasoning_content"] = turn.reasoning
    return msg


def build_messages(agent: AgentSpec, turns: list[UserTurn | LlmTurn]) -> list[dict[str, Any]]:
    """System prompt, then each turn in order; each assistant turn's tool calls are answered by
    exactly one tool message per call id, in the model's call order."""
    messages: list[dict[str, Any]] = []
    system = agent.system_prompt_text
    if system:
        messages.append({"role": "system", "content": system})
    pending_calls: list[str] = []
    pending_names: dict[str, str] = {}
    for turn in turns:
        if isinstance(turn, LlmTurn):
            if pending_calls:
                messages.extend(_missing_answers(pending_calls, pending_names))
            messages.append(_assistant_message(turn))
            pending_calls = [c.id for c in turn.tool_calls]
            pending_names = {c.id: c.name for c in turn.tool_calls}
            continue
        by_id = {r.call_id: r for r in turn.tool_responses}
        media_parts: list[dict[str, Any]] = []
        for call_id in pending_calls:
            r = by_id.get(call_id)
            if r is None:
                messages.extend(_missing_answers([call_id], pending_names))
                continue
            messages.append({"role": "tool", "tool_call_id": call_id, "content": tool_content(r)})
            media_parts.extend(media_part(m) for m in r.media)
        pending_calls, pending_names = [], {}
        if media_parts:
            # Tool messages carry text only on most providers: files a tool returned follow as a user part.
            messages.append(
                {"role": "user", "content": [{"type": "text", "text": "Files returned by the tools:"}, *media_parts]}
            )
        if turn.query is not None:
            messages.append(_query_message(turn.query))
    return messages


def _missing_answers(call_ids: list[str], names: dict[str, str]) -> list[dict[str, Any]]:
    return [
        {
            "role": "tool",
            "tool_call_id": cid,
            "content": f"Error: no result was recorded for {names.get(cid, 'this call')}.",
        }
        for cid in call_ids
    ]
