"""How values are stored: the header hash, turn digests, call outcomes, events and views built from stored JSON."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import ConfigDict, TypeAdapter

from celery_agents.model import CallMeta, CallState, LlmTurn, PendingCall, StoredTurn, TrackedCall, UserTurn
from celery_agents.model.calls import with_raw_arguments

# Built on first use, like the turn models: commands that read no transcript (`pending`) skip it.
STORED_TURN: TypeAdapter[UserTurn | LlmTurn] = TypeAdapter(StoredTurn, config=ConfigDict(defer_build=True))


# Replies are text: the client is made with `decode_responses=True` (store/connection.py), but
# redis-py types a reply `bytes | str` whatever the client, hence the casts to `str` below.
# A stream's entries as XRANGE and XREAD (RESP2) return them: (entry id, fields).
StreamEntries = list[tuple[str, dict[str, str]]]


def turn_digest(previous: str, raw_turns: list[str]) -> str:
    """The digest of a transcript after appending `raw_turns` (JSON exactly as stored) to one whose
    digest is `previous` ("" for none): equal digests, equal turns, whatever their count."""
    digest = previous
    for raw in raw_turns:
        digest = hashlib.sha256(f"{digest}\n{raw}".encode()).hexdigest()[:32]
    return digest


def merge_outcome(call_json: str, outcome_json: str | None) -> TrackedCall:
    data = with_raw_arguments(json.loads(call_json))
    if outcome_json:
        data.update(json.loads(outcome_json))
    return TrackedCall.model_validate(data)


def completion_json(result: Any, *, is_error: bool, by: str | None, now: float) -> str:
    """The outcome recorded when a deferred call is completed from outside."""
    if is_error:
        text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
        return outcome_json(CallState.FAILED, error=text, now=now, completed_by=by, attempts=1)
    return outcome_json(CallState.COMPLETED, result=result, now=now, completed_by=by, attempts=1)


def outcome_json(
    state: CallState,
    *,
    result: Any = None,
    error: str | None = None,
    now: float,
    duration_ms: float | None = None,
    exit_status: int | None = None,
    attempts: int | None = None,
    completed_by: str | None = None,
    meta: CallMeta | None = None,
    started_at: float | None = None,
) -> str:
    """The JSON a final outcome is recorded as (merged over the call when read)."""
    body: dict[str, Any] = {"state": state.value, "finished_at": now}
    if state == CallState.COMPLETED:
        body["result"] = result
    if error is not None:
        body["error"] = error
    for k, v in (
        ("duration_ms", duration_ms),
        ("exit_status", exit_status),
        ("attempts", attempts),
        ("completed_by", completed_by),
        ("meta", meta.stored() if meta else None),
        ("started_at", started_at),
    ):
        if v is not None:
            body[k] = v
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def event_at(eid: str, fields: dict[str, str]) -> float:
    """When an event was written (Redis's clock, s): the milliseconds of its stream id."""
    return int(eid.partition("-")[0]) / 1000


def event_from_entry(eid: str, fields: dict[str, str]) -> dict[str, Any]:
    data = json.loads(fields.get("data") or "{}")
    return {
        "id": eid,
        "type": fields.get("type", ""),
        "at": event_at(eid, fields),
        "version": int(fields.get("version", 0)),
        **data,
    }


#: what a packed value (`packed_entries`) writes as one control character each: the n-th word as
#: character n, the newline skipped (store/lua/_lib.lua `PACK_WORDS`, the same list)
PACK_WORDS = (
    ',"usage":{"prompt_tokens":',
    '{"request":"","owner":"',
    ',"completion_tokens":',
    '","disposition":"',
    '{"from_version":',
    "session_started\n",
    "token_completed\n",
    "tool_dispatched\n",
    '","duration_ms":',
    ',"total_tokens":',
    "step_committed\n",
    '","tool_calls":',
    "PartialUserTurn",
    "token_created\n",
    "tool_finished\n",
    '","request":"',
    "step_started\n",
    '{"call_id":"',
    '","reason":"',
    '","state":"',
    '","agent":"',
    "llm_called\n",
    '{"model":"',
    '{"drive":"',
    '","kind":"',
    '","tool":"',
    ',"head":"',
    ',"cost":',
    "UserTurn",
    "LlmTurn",
)
_UNPACK = [(chr(i + 1 if i < 9 else i + 2), word) for i, word in enumerate(PACK_WORDS)]


def packed_entries(packed: str) -> StreamEntries:
    """The events of a waiting session's packed value (`Keys.packed`, store/lua/_lib.lua
    `pack_events`) as its stream held them: each entry's id is kept as the milliseconds since the
    previous entry's, and each of `PACK_WORDS` as one control character."""
    for code, word in _UNPACK:
        packed = packed.replace(code, word)
    lines = packed.split("\n")
    out: StreamEntries = []
    ms = 0
    for i in range(1, len(lines) - 4, 4):
        step, _, seq = lines[i].partition("-")
        if not (step.isascii() and step.isdigit() and seq.isascii() and seq.isdigit()):
            break  # not as written (another Redis client's value): the rest is left out, as Lua does
        ms += int(step)
        out.append((f"{ms}-{seq}", {"type": lines[i + 1], "version": lines[i + 2], "data": lines[i + 3]}))
    return out


def stream_id(eid: str) -> tuple[int, int]:
    """A stream entry id as a pair of numbers (ids compare as those, not as text)."""
    ms, _, seq = eid.partition("-")
    return int(ms), int(seq or 0)


def unfinished_rows(
    raw_calls: list[str | None], raw_results: list[str | None], started: list[str | None]
) -> list[tuple[TrackedCall, bool]]:
    rows = [
        (merge_outcome(c, r), s is not None)
        for c, r, s in zip(raw_calls, raw_results, started, strict=True)
        if c is not None
    ]
    return sorted((row for row in rows if not row[0].state.final), key=lambda row: (row[0].batch, row[0].position))


def pending_view(session_id: str, call: TrackedCall, started: bool = True, stream: str | None = None) -> PendingCall:
    """`started`: a worker (or the CLI) has begun running a dispatched call; until then its
    state reads `queued`. `stream`: the completions stream of the session's index shard."""
    state = call.state.value
    if call.state == CallState.RUNNING and not started:
        state = "queued"
    return PendingCall(
        session_id=session_id,
        call_id=call.call_id,
        tool=call.tool,
        arguments=call.arguments,
        disposition=call.disposition,
        reason=call.reason,
        state=state,
        token=call.token if call.state == CallState.DEFERRED else None,
        created_at=call.created_at,
        expires_at=call.expires_at,
        kind=("approval" if call.then else "result") if call.state == CallState.DEFERRED else None,
        then=call.then,
        digest=call.digest() if call.state == CallState.DEFERRED else None,
        stream=stream,
    )


def token_message(status: str, token: str) -> str:
    short = token if len(token) <= 80 else token[:77] + "..."
    return {
        "unknown": f"unknown token {short!r}",
        "completed": f"token {short!r} was already completed",
        "expired": f"token {short!r} expired: its deadline passed and the model was told no result came",
        "cancelled": f"token {short!r} can no longer be completed: its call ended another way (its session was "
        "cancelled, or the call was refused)",
        "not_an_approval": f"token {short!r} is not an approval gate: a person supplies its result (complete it)",
        "digest_mismatch": f"token {short!r} waits on another call than the one decided on (the digest differs)",
    }.get(status, f"token {short!r} cannot be completed ({status})")
