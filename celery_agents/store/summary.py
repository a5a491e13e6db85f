"""The one line `session history` shows for each version: what the write that made it did.

Built when the write is made, from what it writes (the step's new turns and calls), so reading the
history reads no transcript; bounded, so a step's write does not grow with what it says. At most
`SUMMARY_MAX` bytes of UTF-8: Redis keeps the versions hash compact (a listpack) only while each of
its values is at most `hash-max-listpack-value` (64) bytes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from celery_agents.model import CallState, LlmTurn, TrackedCall, UserQuery, UserTurn

#: the longest summary kept (bytes of UTF-8)
SUMMARY_MAX = 64


def clip(text: str, limit: int) -> str:
    """`text` on one line, at most `limit` characters (the last one `…` when cut)."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def clip_line(text: str, limit: int = SUMMARY_MAX) -> str:
    """`text` on one line, at most `limit` bytes of UTF-8 (the last character `…` when cut)."""
    line = " ".join(text.split())
    if len(line.encode()) <= limit:
        return line
    cut = line.encode()[: limit - len("…".encode())].decode(errors="ignore")
    return cut + "…"


def start_summary(query: UserQuery) -> str:
    media = f" (+{len(query.media)} attachments)" if query.media else ""
    return clip_line(f"started: {query.text}{media}")


def _call_text(name: str, arguments: Any) -> str:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f"{name}({clip(args, 24)})"


def step_summary(kind: str, turns: Sequence[UserTurn | LlmTurn], calls: Sequence[TrackedCall]) -> str:
    """What a committed step did: the model's answer or the calls it asked for; the tools run,
    dispatched or deferred."""
    parts: list[str] = []
    for turn in turns:
        if isinstance(turn, UserTurn):
            if turn.tool_responses:
                n = len(turn.tool_responses)
                parts.append(f"{n} tool result{'' if n == 1 else 's'} to the model")
            if turn.query is not None:
                parts.append(f"user: {clip(turn.query.text, 40)}")
        elif turn.tool_calls:
            parts.append("model asked for " + ", ".join(_call_text(c.name, c.arguments) for c in turn.tool_calls))
        else:
            parts.append(f"model answered: {clip(turn.text or '', 60)}")
    if calls:
        by_state: dict[str, list[str]] = {}
        for c in calls:
            word = {CallState.RUNNING: "dispatched", CallState.DEFERRED: "deferred"}.get(c.state, c.state.value)
            if c.meta.reused_from:
                word = "reused"
            by_state.setdefault(word, []).append(c.tool)
        parts.insert(0, "; ".join(f"{w} {', '.join(names)}" for w, names in by_state.items()))
    return clip_line(f"{kind}: " + (", ".join(parts) or "no change"))
